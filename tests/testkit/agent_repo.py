"""Shared fixtures (registered in tests/conftest.py): a small real repository in a real local sandbox,
and the agent settings the harness, policy and episode tests run with."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from opencomposer.config import AgentConfig
from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import SandboxUnavailable, make_sandbox

CALC = '''\
"""A tiny calculator."""


def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def total(xs):
    result = 0
    for x in xs:
        result = add(result, x)
    return result
'''


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A workspace: a package, a README, a .git dir the tools must skip."""
    root = tmp_path / "repo"
    (root / "calc").mkdir(parents=True)
    (root / "calc" / "__init__.py").write_text("from calc.core import add, sub, total\n")
    (root / "calc" / "core.py").write_text(CALC)
    (root / "README.md").write_text("# calc\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return root


def open_sandbox(repo: Path, backend: str):
    """A sandbox of ``repo``; skips the test where ``backend`` cannot run here."""
    # env_dir: the test interpreter, so `python` inside the sandbox can import things
    spec = SandboxSpec(base_dir=repo, env_dir=Path(sys.prefix))
    try:
        return make_sandbox(spec, backend)
    except SandboxUnavailable as e:
        pytest.skip(f"{backend} sandbox unavailable: {e}")


@pytest.fixture
def sandbox(repo: Path):
    with open_sandbox(repo, "local") as sb:
        yield sb


@pytest.fixture
def cfg() -> AgentConfig:
    return AgentConfig(command_timeout=5, max_output_chars=2000, search_max_results=5)
