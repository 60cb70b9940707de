"""The tiny ``benchmarks/learn_run.py`` config the bench tests run (tests/bench/test_learn_run.py,
tests/bench/test_cpt_table.py)."""

from __future__ import annotations

from pathlib import Path


def write_config(tmp_path: Path, toolz: Path, out: Path, extra: str = "", name: str = "learn.toml") -> Path:
    """A benchmarks/learn_run.py config at tiny size: tiny-random on the toolz tasks of ``toolz`` (a
    quarter of its files held out), one HumanEval problem in each HumanEval split, one RL step of one
    task x 2 rollouts; ``extra``: TOML appended (further sections)."""
    cfg = tmp_path / name
    cfg.write_text(f"""
[learn]
train_dirs = ["{toolz}"]
heldout_share = 0.25
validation_share = 0.0
humaneval_train = [53]
humaneval_validation = [23]
humaneval_heldout = [2]
oracle_workers = 2
heldout_k = 3
[model]
name = "tiny-random"
[tasks]
dir = "{tmp_path / 'he'}"
[rollout]
k = 2
tasks_per_step = 1
max_new_tokens = 8
backend = "local"
engine = "builtin"
[agent]
max_turns = 4
max_tokens = 2000
[sft]
epochs = 1
[eval]
stages = ["base", "sft", "rl"]
k = 2
[run]
out_dir = "{out}"
steps = 1
""" + extra)
    return cfg
