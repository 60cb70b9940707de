"""Fixtures for the trainer tests: a fresh tiny-random model per test (training mutates it), and a
local sandbox over a one-file repo with a bug (the token-sample and MoE-route tests run episodes in it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from opencomposer.harness.loop import Agent
from opencomposer.policies.scripted import ScriptedPolicy, tool_call
from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import make_sandbox

from opencomposer.models import load_model


@pytest.fixture
def tiny():
    """A fresh (model, tokenizer); tiny-random weights are the same on every load."""
    return load_model("tiny-random")


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a small shared machine, OpenMP threads spinning against other
    jobs made these tiny-model steps 10-20x slower (measured: 0.8 s vs 11 s per rollout)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def transcripts(tmp_path: Path) -> list[Path]:
    """Two transcripts of a scripted (token-less, like the oracle) policy in a real sandbox."""
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    paths = []
    with make_sandbox(SandboxSpec(base_dir=tmp_path / "repo", env_dir=Path(sys.prefix)), "local") as sb:
        for i in range(2):
            policy = ScriptedPolicy([
                [tool_call("read_file", path="calc.py")],
                [tool_call("edit_file", path="calc.py", old="a - b", new="a + b")],
                [tool_call("submit", message=f"fixed add ({i})")],
            ])
            traj = Agent(sb, policy).run("Fix add in calc.py.", task_id=f"t{i}")
            assert traj.exit_reason == "submitted"
            paths.append(traj.save(tmp_path / "transcripts" / f"t{i}.json"))
    return paths


@pytest.fixture
def sandbox(tmp_path: Path):
    """A local sandbox over a one-file repository with a bug (``calc/core.py``'s add subtracts)."""
    (tmp_path / "repo" / "calc").mkdir(parents=True)
    (tmp_path / "repo" / "calc" / "core.py").write_text("def add(a, b):\n    return a - b\n")
    with make_sandbox(SandboxSpec(base_dir=tmp_path / "repo", env_dir=Path(sys.prefix)), "local") as sb:
        yield sb
