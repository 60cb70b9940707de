"""Fixtures for sandbox tests: a tiny venv and one sandbox per backend (over ``base_repo``, tests/testkit).

Namespace cases carry ``@pytest.mark.namespace`` and skip (saying why) where bwrap
cannot build namespaces. Run: ``pytest tests/unit/sandbox -q``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from opencomposer.sandbox import SandboxSpec, make_sandbox
from testkit.sandbox_testutil import NEEDS_NS

BACKENDS = ["local", pytest.param("namespace", marks=NEEDS_NS)]


@pytest.fixture(scope="session")
def venv_dir(tmp_path_factory) -> Path:
    env = tmp_path_factory.mktemp("env") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    return env


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def sandbox(backend, base_repo, tmp_path):
    sb = make_sandbox(SandboxSpec(base_dir=base_repo, pythonpath=["pkg"]), backend=backend, root=tmp_path)
    yield sb
    sb.close()

