"""Shared fixtures for the rl tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import make_sandbox


@pytest.fixture
def sandbox(tmp_path: Path):
    """A local sandbox over a one-file repository with a bug (``calc/core.py``'s add subtracts)."""
    (tmp_path / "repo" / "calc").mkdir(parents=True)
    (tmp_path / "repo" / "calc" / "core.py").write_text("def add(a, b):\n    return a - b\n")
    with make_sandbox(SandboxSpec(base_dir=tmp_path / "repo", env_dir=Path(sys.prefix)), "local") as sb:
        yield sb
