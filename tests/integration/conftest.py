"""Shared real fixtures: tasks made from a real PyPI library (toolz), once per session.

Needs PyPI (sdist + pytest for the library's environment); everything else is local.
"""

from __future__ import annotations

import subprocess
import tarfile
import textwrap
from pathlib import Path

import pytest

from opencomposer.sandbox.namespace import unavailable_reason

TOOLZ = "pypi:toolz==1.2.0"
NS_REASON = unavailable_reason()
BACKENDS = ["local", pytest.param("namespace", marks=pytest.mark.skipif(bool(NS_REASON), reason=str(NS_REASON)))]


@pytest.fixture(scope="session")
def toolz_tasks(tmp_path_factory) -> Path:
    from opencomposer.tasks.make import make_tasks

    out = tmp_path_factory.mktemp("tasks")
    rep = make_tasks(TOOLZ, out, max_tasks=4, seed=1, backend="local", levels=("body", "function"))
    assert len(rep.made) == 4, rep
    return out


def make_sdist(tmp: Path, name: str, files: dict[str, str]) -> Path:
    """A real .tar.gz sdist of a tiny project (PKG-INFO + the given files)."""
    root = tmp / f"{name}-0.1"
    for rel, text in {"PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n", **files}.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    archive = tmp / f"{name}-0.1.tar.gz"
    with tarfile.open(archive, "w:gz") as t:
        t.add(root, arcname=root.name)
    return archive


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    import sys
    return subprocess.run([sys.executable, "-m", "opencomposer.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)
