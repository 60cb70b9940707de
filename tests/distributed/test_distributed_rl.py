"""`opencomposer train` under torchrun: the trainer sharded over 2 gloo ranks (CPU), rank 0
the actor (tasks, oracle traces, the built-in engine, sandboxes, evals, logs), against the
same config in one process.

Run: ``pytest tests/distributed/test_distributed_rl.py`` (a few minutes on 2 cores; needs PyPI once
for the toolz tasks, tests/testkit/rl_tasks.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opencomposer.config import load_config
from opencomposer.models.registry import load_model
from opencomposer.rl.config import RLRunConfig
from opencomposer.train.checkpoint import load_checkpoint
from opencomposer.train.trainer import Trainer

from testkit.rl_tasks import write_cfg


def sharded_cfg(tmp: Path, tasks: Path, out: Path) -> Path:
    """Two RL steps with the SFT warm start (its traces broadcast, its steps sharded), a KL
    term (the reference sharded too) and the built-in engine fed from gathered weights."""
    path = write_cfg(tmp, tasks, out, steps=2, kl=0.05, engine="builtin")
    text = path.read_text().replace("[sft]\nenabled = false", "[sft]\nenabled = true\nmax_traces = 2\nepochs = 1")
    text = text.replace("[run]\n", '[eval]\nstages = ["sft", "rl"]\n[run]\n')
    text = text.replace("max_turns = 2", "max_turns = 4")  # the compact oracle's traces need 4
    # fp32: bf16 autocast (on where the CPU has it) would round the two runs' SFT weights apart
    # enough to flip a sampled token; in fp32 they differ by float-sum order only
    text = text.replace("[train]\n", "[train]\nbf16 = false\n")
    # greedy: a sampled request's seed depends on which model call it joins (episodes batch by
    # timing, policies/batched.py), so sampled rollouts differ between two runs; greedy ones are a
    # function of the weights alone, which is what the two runs are compared on
    text = text.replace("temperature = 1.0", "temperature = 0.0")
    path.write_text(text)
    return path


def train(config: Path, nproc: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m"] \
        if nproc > 1 else [sys.executable, "-m"]
    proc = subprocess.run([*launch, "opencomposer.cli", "train", "--config", str(config)], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc, [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]


def rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_under_torchrun_matches_one_process(toolz_tasks: Path, tmp_path: Path):
    two, one = tmp_path / "two", tmp_path / "one"
    proc, lines = train(sharded_cfg(tmp_path, toolz_tasks, two), nproc=2)
    assert len(lines) == 1, proc.stdout  # one result line: rank 0's
    result = json.loads(lines[0])
    assert result["steps"] == 2 and set(result["evals"]) == {"sft", "rl"}
    sharded = rows(two)
    assert [r["step"] for r in sharded] == [1, 2]  # one metrics row a step, not one a rank
    assert all(r["policy_version"] > 0 for r in sharded)
    assert (two / "sft_model").is_dir() and (two / "report.md").is_file()

    train(sharded_cfg(tmp_path, toolz_tasks, one), nproc=1)
    single = rows(one)
    # the same tasks, and the first step's rollouts from the same (SFT) weights (the sharded
    # SFT's weights equal the single process's): the same rewards, tokens, loss and KL
    assert [r["task_ids"] for r in sharded] == [r["task_ids"] for r in single]
    assert sharded[0]["reward_mean"] == single[0]["reward_mean"]
    assert sharded[0]["train_tokens"] == single[0]["train_tokens"]
    for key in ("loss", "kl"):
        assert sharded[0][key] == pytest.approx(single[0][key], rel=1e-3, abs=1e-6), key
    sft = [load_model(str(run / "sft_model"))[0].state_dict() for run in (two, one)]
    assert max(float((sft[0][k] - sft[1][k]).abs().max()) for k in sft[1]) < 1e-5
    # the sharded run's checkpoint is an ordinary one (the same files), and RL moved its weights.
    # Not compared number for number: this step's rewards are all 0, so its only gradient is
    # the KL term's sum of nearly cancelling score functions, whose residue depends on the
    # order of float sums, and AdamW's first step moves every weight by ~lr in its sign (the
    # unit tests compare sharded and single updates where the gradient is well conditioned).
    from safetensors import safe_open
    names = []
    for run in (two, one):
        with safe_open(str(run / "checkpoints" / "step-0002" / "model" / "model.safetensors"), "pt") as f:
            names.append(sorted(f.keys()))
    assert names[0] == names[1]
    cfg = load_config(sharded_cfg(tmp_path, toolz_tasks, tmp_path / "unused"), RLRunConfig)
    trained, sft = Trainer(*load_model("tiny-random"), cfg.train), load_model(str(two / "sft_model"))[0]
    assert load_checkpoint(two / "checkpoints", trained)["step"] == 2
    assert any(not torch.equal(a, b) for a, b in zip(trained.model.parameters(), sft.parameters()))
