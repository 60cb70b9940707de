"""Resuming on another machine: an RL run of tiny-random with LoRA on real toolz tasks in real
sandboxes, stopped after step 1, its carry set (``pipeline/carry.py``) copied to a fresh directory
of another path and nothing else, resumed there for step 2: the step's metrics and the final
adapter, optimizer and RNG states are those of the run that was never stopped, bit for bit.
A resume whose seed or model differs from the checkpoint's is refused, naming the setting.

One episode at a time (k = 1, one task a step, synchronous): batched sampling of concurrent
episodes is not reproducible even without a stop (``policies/batched.py``).

Run: ``pytest tests/integration/test_resume_carried.py`` (about two minutes on 2 cores; needs PyPI
once for the toolz tasks). ``python tests/integration/test_resume_carried.py --measure`` measures
the carry set of SmolLM2-135M (LoRA r=16, and full fine-tuning) and prints one JSON line.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opencomposer.config import ConfigError, load_config
from opencomposer.pipeline.carry import copy_carry
from opencomposer.pipeline.run import run_pipeline
from opencomposer.rl.config import RLRunConfig
from opencomposer.rl.metrics import wall_clock
from opencomposer.train.checkpoint import resolve_checkpoint

try:
    from testkit.rl_tasks import write_cfg
except ImportError:  # run as a script (--measure): the tasks are not needed
    write_cfg = None

# a LoRA checkpoint's part of the carry set: the adapter's files and the state, not the tokenizer
LORA_STEP = ("optimizer.pt", "rng.pt", "trainer.json", "state.json", "model/adapter_model.safetensors",
             "model/adapter_config.json")


def config(tmp: Path, tasks: Path, out: Path, steps: int, name: str, **edits: str) -> RLRunConfig:
    text = write_cfg(tmp, tasks, out, steps=steps, kl=0.05).read_text()
    text = text.replace("k = 2", "k = 1").replace("lr = 1e-3", "lr = 1e-2\nlora = true\nlora_r = 4")
    text += "[eval]\nstages = []\n"
    for old, new in edits.items():
        text = text.replace(old, new)
    p = tmp / f"{name}.toml"
    p.write_text(text)
    return load_config(p, RLRunConfig)


def rows(out: Path) -> list[dict]:
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def timeless(row: dict) -> dict:
    return {k: v for k, v in row.items() if not wall_clock(k)}


def test_a_run_resumed_from_its_carry_set_elsewhere_matches_the_one_never_stopped(toolz_tasks: Path, tmp_path: Path):
    whole, stopped, fresh = tmp_path / "whole", tmp_path / "stopped", tmp_path / "other-machine" / "run"
    run_pipeline(config(tmp_path, toolz_tasks, whole, 2, "whole"), log=lambda m: None)
    run_pipeline(config(tmp_path, toolz_tasks, stopped, 1, "stopped"), log=lambda m: None)
    carried = copy_carry(stopped, fresh)
    assert set(carried["paths"]) == {"checkpoints/latest", "split.json", "metrics.jsonl",
                                     *(f"checkpoints/step-0001/{f}" for f in LORA_STEP)}
    assert carried["fits"], carried
    shutil.rmtree(stopped)  # nothing else of the first machine is left
    res = run_pipeline(config(tmp_path, toolz_tasks, fresh, 2, "fresh"), resume=True, log=lambda m: None)
    assert res["steps"] == 1
    a, c = rows(whole), rows(fresh)
    assert [r["step"] for r in c] == [1, 2]
    assert timeless(c[1]) == timeless(a[1]) and timeless(c[0]) == timeless(a[0])
    assert c[1]["train_tokens"] > 0 and c[1]["kl"] != 0.0  # an update that moved the adapter
    ca, cc = resolve_checkpoint(whole / "checkpoints"), resolve_checkpoint(fresh / "checkpoints")
    assert ca.name == cc.name == "step-0002"
    wa, wc = (load_file(d / "model" / "adapter_model.safetensors") for d in (ca, cc))
    assert wa.keys() == wc.keys() and all(torch.equal(wa[k], wc[k]) for k in wa)
    oa, oc = (torch.load(d / "optimizer.pt", weights_only=True)["state"] for d in (ca, cc))
    assert oa.keys() == oc.keys() and all(torch.equal(oa[i][k], oc[i][k]) for i in oa for k in oa[i])
    ra, rc = (torch.load(d / "rng.pt", weights_only=False) for d in (ca, cc))
    assert torch.equal(ra["torch"], rc["torch"])
    sa, sc = (json.loads((d / "state.json").read_text()) for d in (ca, cc))
    assert sa["sampler"] == sc["sampler"] and sa["sampling_calls"] == sc["sampling_calls"] > 0
    assert sa["identity"] == sc["identity"]

    # the carried run resumed with another seed, or another model: refused before anything runs
    for edit, setting in (({"steps = 2": "steps = 3\nseed = 7"}, "run.seed = 7"),
                          ({'name = "tiny-random"': 'name = "tiny-random-moe"'}, "model.name = 'tiny-random-moe'")):
        before = (fresh / "metrics.jsonl").read_text()
        with pytest.raises(ConfigError, match="model.name|run.seed") as e:
            run_pipeline(config(tmp_path, toolz_tasks, fresh, 2, "other", **edit), resume=True, log=lambda m: None)
        assert setting in str(e.value) and "the checkpoint" in str(e.value)
        assert (fresh / "metrics.jsonl").read_text() == before


# --------------------------------------------------------------------------- measure (a script)


def measure(out: Path, model: str = "smollm2-135m") -> dict:
    """One LoRA (r=16) update of ``model`` on CPU, checkpointed: its carry set's size; and what
    full fine-tuning's would be (fp32 weights and AdamW moments, by count: a checkpoint of it is
    not written here)."""
    from testkit.train_data import rollout_samples

    from opencomposer.models.registry import load_model
    from opencomposer.pipeline.carry import carry_state, size_of
    from opencomposer.rl.learner import Learner, TrainBatch
    from opencomposer.train import distributed

    cfg = RLRunConfig(tasks={"dir": "unused"}, model={"name": model}, loss={"kl_coef": 0.0},
                      train={"lr": 1e-4, "bf16": False, "lora": True, "lora_r": 16},
                      rollout={"temperature": 1.0}, run={"steps": 1})
    ln = Learner(cfg, out, model, distributed.SINGLE, "cpu", task_ids=["t"])
    samples = rollout_samples(*load_model(model), n=2, max_new_tokens=8)
    ln.update(TrainBatch(samples, pairs=[], rollouts=2))
    ln.save(1, {"sampler": {}, "row": {"step": 1}})
    sizes = {str(p): size_of(out / p) for p in carry_state(out, cfg)}
    params = sum(p.numel() for p in load_model(model)[0].parameters())
    adapter = sum(p.numel() for p in ln.trainer.model.parameters() if p.requires_grad)
    lora = sum(sizes.values())
    full = params * (4 + 8)  # fp32 weights + AdamW exp_avg and exp_avg_sq (fp32)
    full_bf16 = params * (2 + 8)  # bf16 weights; the moments stay fp32
    return {"model": model, "params": params, "lora_r": 16, "adapter_params": adapter,
            "lora_carry_bytes": lora, "lora_carry_mib": round(lora / 2**20, 2), "lora_paths": sizes,
            "full_ft_carry_mib_fp32": round(full / 2**20, 1), "full_ft_carry_mib_bf16_weights": round(full_bf16 / 2**20, 1),
            "limit_mib": 64, "lora_fits": lora <= 64 << 20, "full_fits": full_bf16 <= 64 << 20}


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: testkit
    if "--measure" not in sys.argv:
        sys.exit("usage: python tests/integration/test_resume_carried.py --measure [MODEL]")
    args = [a for a in sys.argv[1:] if a != "--measure"]
    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(measure(Path(d), *args)))
