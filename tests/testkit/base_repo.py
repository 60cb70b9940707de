"""A tiny base repository for sandbox tests and the sandbox benchmark's test (registered in tests/conftest.py).

    def test_x(base_repo): ...   # tmp/repo: pkg/__init__.py, pkg/mod.py (add), README.md, data/keep.txt
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def base_repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "README.md").write_text("# demo\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text("def add(a, b):\n    return a + b\n")
    (root / "data" / "keep.txt").write_text("keep\n")
    return root
