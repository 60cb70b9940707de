"""The pipeline's ``[pretrain]`` stage: tiny-random continues pretraining on a few of this repo's
own source files, stops mid-way, resumes, and its export is what SFT, RL and the KL reference
start from; a done stage is skipped on ``--resume``. Tasks: the repo's smoke fixtures
(``configs/suites/tasks/smoke``), run with this interpreter, so nothing is downloaded.

Run: ``pytest tests/integration/test_pipeline_pretrain.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import opencomposer.pipeline.run as pipeline
from opencomposer.config import load_config
from opencomposer.models.registry import load_model
from opencomposer.rl.config import RLRunConfig
from opencomposer.pipeline.run import run_pipeline
from opencomposer.rl.run import RLRun
from opencomposer.train.corpus import Mix

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "suites" / "tasks" / "smoke"
CODE = ["rl/config.py", "pipeline/run.py", "rl/sampler.py", "rl/advantages.py", "train/loss.py", "train/corpus.py",
        "train/pretrain.py", "train/sft.py"]


@pytest.fixture
def tasks(tmp_path: Path) -> Path:
    """The five smoke tasks, their tests run by this interpreter (they need no environment of their own)."""
    out = tmp_path / "tasks"
    shutil.copytree(SMOKE, out)
    from opencomposer.tasks.envs import adopt_env

    env = adopt_env(out, Path(sys.prefix)).name  # linked into the environments root
    for toml in out.glob("*/task.toml"):
        toml.write_text(toml.read_text().replace('env = ""', f'env = "../_envs/{env}"'))
    return out


@pytest.fixture
def code(tmp_path: Path) -> Path:
    """Eight of this repo's modules, copied so the paths (and the held-out split) are fixed."""
    d = tmp_path / "code"
    for rel in CODE:
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "src" / "opencomposer" / rel, d / rel)
    return d


def write_cfg(tmp: Path, tasks: Path, code: Path, out: Path, *, steps: int = 3, sft: bool = True,
              engine: str = "hf") -> RLRunConfig:
    p = tmp / "cpt.toml"  # the file, for a command line
    p.write_text(f"""
[model]
name = "tiny-random"
[tasks]
dir = "{tasks}"
heldout = 1
[rollout]
engine = "{engine}"
k = 2
tasks_per_step = 1
temperature = 1.0
max_new_tokens = 12
backend = "local"
[agent]
max_turns = 4
max_tokens = 4000
[loss]
kl_coef = 0.05
[train]
lr = 1e-3
[pretrain]
enabled = true
data = ["{code}"]
steps = {steps}
seq_len = 32
batch_size = 4
lr = 3e-3
warmup_steps = 1
held_out = 0.25
eval_every = 0
eval_windows = 8
save_every = 1
[sft]
enabled = {str(sft).lower()}
epochs = 1
max_traces = 1
[eval]
stages = []
[run]
out_dir = "{out}"
steps = 1
""")
    return load_config(p, RLRunConfig)



def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sft_and_rl_start_from_the_pretrained_model_and_resume_skips_it(tasks, code, tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg = write_cfg(tmp_path, tasks, code, out)
    # 1. stopped during step 3 of continued pretraining, after the checkpoint of step 2
    draw = Mix.batch_for_step

    def stop_at_2(self, step):
        if step == 2:
            raise KeyboardInterrupt
        return draw(self, step)

    monkeypatch.setattr(Mix, "batch_for_step", stop_at_2)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(cfg, log=lambda m: None)
    assert (out / "pretrain" / "checkpoints" / "step-0002").is_dir()
    assert not (out / "pretrain" / "result.json").exists() and not (out / "sft.json").exists()
    monkeypatch.setattr(Mix, "batch_for_step", draw)

    # 2. --resume: the stage continues at step 2, then SFT starts from its export
    seen: list[dict] = []
    sft = pipeline.sft_warm_start

    def spy(trainer, *args, **kw):
        seen.append(_weights(trainer.model))
        return sft(trainer, *args, **kw)

    monkeypatch.setattr(pipeline, "sft_warm_start", spy)
    logs: list[str] = []
    result = run_pipeline(cfg, resume=True, log=logs.append)
    saved = json.loads((out / "pretrain" / "result.json").read_text())
    assert saved["resumed_from"] == 2 and saved["steps"] == 3 and len(saved["history"]) == 3
    exported = _weights(load_model(str(out / "pretrain" / "model"))[0])
    base = _weights(load_model("tiny-random")[0])
    assert len(seen) == 1 and _equal(seen[0], exported) and not _equal(exported, base)
    assert result["start_model"] == saved["model_dir"] == str(out / "pretrain" / "model")
    cpt = result["pretrain"]
    assert cpt["loss_before"]["held_out"] == saved["before"]["held_out"]["loss"]
    assert cpt["loss_after"]["held_out"] == saved["after"]["held_out"]["loss"] < cpt["loss_before"]["held_out"]
    assert "## Continued pretraining" in (out / "report.md").read_text()
    assert any(f"SFT warm start on oracle traces, from {out / 'pretrain' / 'model'}" in m for m in logs)
    assert result["steps"] == 1 and json.loads((out / "sft.json").read_text())["traces"] == 1

    # 3. --resume again: the stage is done, so it is skipped (its files untouched)
    stamp = (out / "pretrain" / "result.json").stat().st_mtime_ns
    logs.clear()
    again = run_pipeline(cfg, resume=True, log=logs.append)
    assert (out / "pretrain" / "result.json").stat().st_mtime_ns == stamp
    assert any("continued pretraining: done" in m and "skipped" in m for m in logs)
    assert again["pretrain"] == cpt and len(seen) == 1  # SFT was done too


def test_without_sft_the_kl_reference_is_the_pretrained_model(tasks, code, tmp_path, monkeypatch):
    out = tmp_path / "nosft"
    cfg = write_cfg(tmp_path, tasks, code, out, steps=2, sft=False)
    refs: list[dict] = []
    reference = RLRun.reference

    def spy(self):
        ref = reference(self)
        if not refs:
            refs.append(_weights(ref))
        return ref

    monkeypatch.setattr(RLRun, "reference", spy)
    result = run_pipeline(cfg, log=lambda m: None)
    assert result["pretrain"]["steps"] == 2 and result["pretrain"]["resumed_from"] == 0
    exported = _weights(load_model(str(out / "pretrain" / "model"))[0])
    assert _equal(refs[0], exported)
    # a resumed RL run reloads its reference from disk: the export again, not [model] name
    refs.clear()
    cfg.run.steps = 2
    result = run_pipeline(cfg, resume=True, log=lambda m: None)
    assert result["steps"] == 1 and result["pretrain"]["resumed_from"] == 0  # the stage was skipped
    assert _equal(refs[0], exported)
    # without --resume every stage starts over, continued pretraining too
    cfg.run.steps = 1
    result = run_pipeline(cfg, log=lambda m: None)
    assert result["pretrain"]["resumed_from"] == 0


def test_under_torchrun_every_rank_pretrains_and_rank_0_reports(tasks, code, tmp_path):
    """2 gloo ranks: the stage is sharded (its result says world_size 2), SFT starts from its
    export on every rank, one result line (rank 0's) carries its losses; --resume skips it."""
    import os
    import subprocess

    out = tmp_path / "two"
    write_cfg(tmp_path, tasks, code, out, engine="builtin")  # "hf" samples with the sharded model: refused
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
              "opencomposer.cli", "train", "--config", str(tmp_path / "cpt.toml")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for resume in ([], ["--resume"]):
        proc = subprocess.run(launch + resume, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-5000:]
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        assert len(lines) == 1, proc.stdout
        result = json.loads(lines[0])
        assert result["start_model"] == str(out / "pretrain" / "model") and result["pretrain"]["steps"] == 3
        log = "".join(proc.stderr.split())  # the console wraps long lines
        if not resume:
            assert f"SFTwarmstartonoracletraces,from{out / 'pretrain' / 'model'}" in log
        else:
            assert "continuedpretraining:done" in log and "SFTwarmstart" not in log
    saved = json.loads((out / "pretrain" / "result.json").read_text())
    assert saved["world_size"] == 2 and result["pretrain"]["loss_after"]["held_out"] == saved["after"]["held_out"]["loss"]
