"""Shared RL-run fixtures (registered in tests/conftest.py), for the integration tier and the
distributed tier (tests/distributed/test_distributed_rl.py):

    toolz_tasks      # four tasks made from a real PyPI library, toolz 1.2.0 (once per session; needs PyPI)

and ``write_cfg``, a small ``opencomposer train`` config over such tasks. tests/adversarial
has its own ``toolz_tasks`` (the tasks loaded).
"""

from __future__ import annotations

from pathlib import Path

import pytest

TOOLZ = "pypi:toolz==1.2.0"


@pytest.fixture(scope="session")
def toolz_tasks(tmp_path_factory) -> Path:
    from opencomposer.tasks.make import make_tasks

    out = tmp_path_factory.mktemp("tasks")
    rep = make_tasks(TOOLZ, out, max_tasks=4, seed=1, backend="local", levels=("body", "function"))
    assert len(rep.made) == 4, rep
    return out


def write_cfg(tmp: Path, tasks: Path, out: Path, steps: int, kl: float, model: str = "tiny-random",
              engine: str = "hf", sync: Path | None = None, base_url: str | None = None) -> Path:
    """A small RL run's TOML over ``tasks`` (no SFT warm start; ``[sync]`` when ``sync`` is a
    store), written under ``tmp``; tests edit its text for what they add."""
    text = f"""
[model]
name = "{model}"
[tasks]
dir = "{tasks}"
heldout = 1
[rollout]
engine = "{engine}"
{f'base_url = "{base_url}"' if base_url else ""}
k = 2
tasks_per_step = 1
temperature = 1.0
max_new_tokens = 12
backend = "local"
[agent]
max_turns = 2
max_tokens = 4000
[loss]
kl_coef = {kl}
[train]
lr = 1e-3
[sft]
enabled = false
[run]
out_dir = "{out}"
steps = {steps}
"""
    if sync is not None:
        text += f'[sync]\nstore = "{sync}"\ndtype = "float32"\n'
    p = tmp / f"rl-{kl}.toml"
    p.write_text(text)
    return p
