"""Fixtures for the trainer tests: a fresh tiny-random model per test (training mutates it), one
intra-op thread for each, and a local sandbox over a one-file repo with a bug (the token-sample
and MoE-route tests run episodes in it). ``transcripts`` and the rollout helpers are shared with
tests/distributed: tests/testkit/train_data.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from opencomposer.models import load_model
from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import make_sandbox


@pytest.fixture
def tiny():
    """A fresh (model, tokenizer); tiny-random weights are the same on every load."""
    return load_model("tiny-random")


@pytest.fixture(autouse=True)
def _one_thread_each(one_thread):
    """Every trainer test on one intra-op thread (``one_thread``: tests/testkit/train_data.py)."""


@pytest.fixture
def sandbox(tmp_path: Path):
    """A local sandbox over a one-file repository with a bug (``calc/core.py``'s add subtracts)."""
    (tmp_path / "repo" / "calc").mkdir(parents=True)
    (tmp_path / "repo" / "calc" / "core.py").write_text("def add(a, b):\n    return a - b\n")
    with make_sandbox(SandboxSpec(base_dir=tmp_path / "repo", env_dir=Path(sys.prefix)), "local") as sb:
        yield sb
