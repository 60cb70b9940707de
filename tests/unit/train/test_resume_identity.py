"""Resuming on another machine, at the learner: a checkpoint records what the run was (model and
the fingerprint of its weights, training task pool, seed, loss and LoRA settings) and a resume of
another run is refused naming the setting and both values; a run resumed from its carry set alone
(``pipeline/carry.py``), copied to a fresh directory, takes the same next update, bit for bit, as
the run that was never stopped (LoRA and full fine-tuning). tiny-random, fixed batches, one process.

Run: ``pytest tests/unit/train/test_resume_identity.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from testkit.train_data import rollout_samples

from opencomposer.config import ConfigError
from opencomposer.models.registry import load_model
from opencomposer.pipeline.carry import carry_state, copy_carry
from opencomposer.pipeline.carry import main as carry_main
from opencomposer.rl.config import RLRunConfig
from opencomposer.rl.learner import Learner, TrainBatch
from opencomposer.train import distributed
from opencomposer.train.checkpoint import (check_identity, names_fingerprint, resolve_checkpoint,
                                           weights_fingerprint)

TASKS = ["task-a", "task-b", "task-c"]


def config(lora: bool, seed: int = 0, model: str = "tiny-random", kl: float = 0.05, steps: int = 3) -> RLRunConfig:
    return RLRunConfig(tasks={"dir": "unused"}, model={"name": model}, loss={"kl_coef": kl},
                       train={"lr": 1e-3, "bf16": False, "lora": lora, "lora_r": 4, "warmup_steps": 2},
                       rollout={"temperature": 1.0}, run={"steps": steps, "save_every": 1, "seed": seed})


def learner(out: Path, lora: bool = True, tasks: list[str] = TASKS, start: str = "tiny-random",
            grown_from: list[str] | None = None, **kw) -> Learner:
    return Learner(config(lora, **kw), out, start, distributed.SINGLE, "cpu", task_ids=tasks, grown_from=grown_from)


def batches(n: int = 3) -> list[TrainBatch]:
    """The same ``n`` batches on every call: real samples of the untrained model, fixed seeds."""
    model, tok = load_model("tiny-random")
    return [TrainBatch(rollout_samples(model, tok, n=2, seed=s, max_new_tokens=8), pairs=[], rollouts=2)
            for s in range(n)]


def carried_checkpoint(step: str, lora: bool) -> set[str]:
    """What the carry set holds of a checkpoint: LoRA, the adapter's files and the state, not the
    tokenizer (the base model's); full fine-tuning, the whole step directory."""
    if not lora:
        return {"checkpoints/latest", f"checkpoints/{step}"}
    return {"checkpoints/latest", *(f"checkpoints/{step}/{f}" for f in (
        "optimizer.pt", "rng.pt", "trainer.json", "state.json", "model/adapter_model.safetensors",
        "model/adapter_config.json"))}


def trainable(ln: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in ln.trainer.model.named_parameters() if p.requires_grad}


def saved(ln: Learner, step: int) -> None:
    ln.save(step, {"sampler": {"used": TASKS[:step]}, "row": {"step": step}})


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_run_resumed_from_its_carry_set_in_a_fresh_dir_matches_the_uninterrupted_one(tmp_path: Path, lora: bool):
    whole, stopped, fresh = tmp_path / "whole", tmp_path / "stopped", tmp_path / "elsewhere" / "fresh"
    a = learner(whole, lora)
    rows = []
    for i, b in enumerate(batches(), 1):
        rows.append(a.update(b))
        saved(a, i)
    b_ = learner(stopped, lora)
    for i, b in enumerate(batches(2), 1):
        b_.update(b)
        saved(b_, i)
    # the stopped run's carry set alone, in a directory of another path; the rest is gone
    (stopped / "tb").mkdir()
    (stopped / "tb" / "events").write_text("x")
    carried = copy_carry(stopped, fresh)
    assert set(carried["paths"]) == carried_checkpoint("step-0002", lora), carried["paths"]
    assert carried["fits"] and carried["bytes"] > 0
    shutil.rmtree(stopped)
    c = learner(fresh, lora)
    step, state = c.resume()
    assert (step, state["row"], c.version) == (2, {"step": 2}, 2) and c.resume_warning is None
    row = c.update(batches()[2])
    assert row == rows[2]  # the next update's metrics, every one, exactly
    mine, theirs = trainable(a), trainable(c)
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    sa, sc = a.trainer.optimizer.state_dict()["state"], c.trainer.optimizer.state_dict()["state"]
    assert sa.keys() == sc.keys() and all(torch.equal(sa[i][k], sc[i][k]) for i in sa for k in sa[i])
    if lora:  # only the adapter travels
        assert not list((fresh / "checkpoints" / "step-0002" / "model").glob("model*.safetensors"))


def stopped_run(out: Path) -> Learner:
    ln = learner(out)
    ln.update(batches(1)[0])
    saved(ln, 1)
    return ln


@pytest.mark.parametrize("change, setting, theirs, ours", [
    ({"seed": 1}, "run.seed", "0", "1"),
    ({"tasks": ["task-a", "task-b", "task-d"]}, "tasks.train_pool",
     repr(names_fingerprint(TASKS)), repr(names_fingerprint(["task-a", "task-b", "task-d"]))),
    ({"model": "tiny-random-moe", "start": "tiny-random-moe"}, "model.name", "'tiny-random'", "'tiny-random-moe'"),
    ({"kl": 0.1}, "loss.kl_coef", "0.05", "0.1"),
    ({"lora": False}, "train.lora", "True", "False"),
])
def test_resuming_another_runs_checkpoint_is_refused_naming_the_setting(tmp_path: Path, change, setting, theirs,
                                                                       ours):
    ln = stopped_run(tmp_path)
    other = learner(tmp_path, **change)
    with pytest.raises(ConfigError) as e:
        other.resume()
    msg = str(e.value)
    assert f"{setting} = {theirs}" in msg and f"{setting} = {ours}" in msg, msg
    assert other.version == 0 and ln.version == 1  # nothing was loaded


def test_a_pool_that_only_grew_resumes_and_its_next_checkpoint_records_it(tmp_path: Path):
    """Single-epoch RL whose pool gained tasks mid-run (grown_from: the pool the checkpoint was written
    with): resumed, said in resume_note, with the state saved; a pool that lost a task, a grown_from that is
    not the checkpoint's pool, or another setting changed with it is refused as before."""
    stopped_run(tmp_path)
    grown = [*TASKS, "task-d", "task-e"]
    with pytest.raises(ConfigError, match="tasks.train_pool"):
        learner(tmp_path, tasks=grown).resume()  # not said to have grown: refused
    with pytest.raises(ConfigError, match="tasks.train_pool"):
        learner(tmp_path, tasks=grown, grown_from=["task-a", "task-b"]).resume()  # not the checkpoint's pool
    with pytest.raises(ConfigError, match="run.seed"):
        learner(tmp_path, tasks=grown, grown_from=TASKS, seed=1).resume()
    with pytest.raises(ValueError, match=r"a pool only grows; .*\['task-c'\]"):
        learner(tmp_path, tasks=["task-a", "task-b", "task-d"], grown_from=TASKS)
    ln = learner(tmp_path, tasks=grown, grown_from=TASKS)
    step, state = ln.resume()
    assert (step, state["row"], ln.version) == (1, {"step": 1}, 1)
    assert ln.resume_note and "grew from 3 to 5 tasks" in ln.resume_note
    ln.update(batches(2)[1])
    saved(ln, 2)  # written with the grown pool: resumes without grown_from now, and no longer with the old pool
    again = learner(tmp_path, tasks=grown)
    assert again.resume()[0] == 2 and again.resume_note is None
    with pytest.raises(ConfigError, match="tasks.train_pool"):
        learner(tmp_path).resume()


def test_the_same_model_name_with_other_weights_is_refused(tmp_path: Path):
    """What a [pretrain] stage (or another build of the model) starts from: the name agrees, the
    weights' fingerprint does not."""
    stopped_run(tmp_path / "run")
    model, tok = load_model("tiny-random")
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
    model.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    other = learner(tmp_path / "run", start=str(tmp_path / "other"))
    with pytest.raises(ConfigError, match=r"model\.weights = 'sha256:[0-9a-f]{16}'.*model\.weights = 'sha256:"):
        other.resume()


def test_a_checkpoint_without_an_identity_resumes_with_a_warning(tmp_path: Path):
    ln = stopped_run(tmp_path)
    state_file = resolve_checkpoint(ln.ckpt_dir) / "state.json"
    state = json.loads(state_file.read_text())
    del state["identity"]
    state_file.write_text(json.dumps(state))
    again = learner(tmp_path, seed=5)  # even another seed: nothing to compare it with
    with pytest.warns(UserWarning, match="records no run identity"):
        assert again.resume()[0] == 1
    assert "resuming unverified" in again.resume_warning and again.version == 1


def test_fingerprints_name_what_they_cover(tmp_path: Path):
    m1, m2 = load_model("tiny-random")[0], load_model("tiny-random")[0]
    assert weights_fingerprint(m1) == weights_fingerprint(m2)
    assert weights_fingerprint(m1) != weights_fingerprint(m1.to(torch.bfloat16))
    assert names_fingerprint(["b", "a", "a"]) == names_fingerprint(["a", "b"]) != names_fingerprint(["a"])
    assert names_fingerprint(["a", "b"]).endswith("(2)")
    ln = stopped_run(tmp_path)
    assert check_identity(ln.ckpt_dir, ln.identity) is None
    assert check_identity(ln.ckpt_dir, {"something.new": 1}) is None  # only what both record is compared


def test_the_carry_set_is_the_latest_checkpoint_and_the_runs_records(tmp_path: Path, capsys):
    out = tmp_path / "run"
    ln = learner(out, lora=False, kl=0.05, steps=4)
    for i in range(1, 4):
        saved(ln, i)  # keep_checkpoints = 2: step-0002 and step-0003 remain
    for f in ("split.json", "metrics.jsonl", "evals.json", "sft.json", "report.md", "tb/e", "traces/t.json",
              "evals/rl/x.json", "sft_model/model.safetensors"):
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        (out / f).write_text("{}")
    rel = {str(p) for p in carry_state(out)}
    assert rel == {"checkpoints/latest", "checkpoints/step-0003", "split.json", "metrics.jsonl", "evals.json",
                   "sft.json", "sft_model"}  # full fine-tuning: the KL reference may be read from sft_model
    assert "sft_model" not in {str(p) for p in carry_state(out, config(lora=False, kl=0.0))}
    with pytest.raises(ValueError, match="outside the run directory"):
        copy_carry(out, out / "carry")
    # python -m opencomposer.pipeline.carry OUT DEST: copies, then one JSON line
    assert carry_main([str(out), str(tmp_path / "dest")]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(line["paths"]) == rel and line["fits"] and (tmp_path / "dest" / "checkpoints" / "latest").is_file()
