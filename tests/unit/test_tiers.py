"""The tiers of tests/ (tests/conftest.py): every test file sits in a tier folder and gets its marker.

Test: ``pytest -q tests/unit/test_tiers.py``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
# tests/conftest.py by its path: the name "conftest" belongs to whichever conftest pytest loaded last
_spec = importlib.util.spec_from_file_location("tests_tiers_conftest", TESTS / "conftest.py")
_tiers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tiers)
TIERS, tier_of = _tiers.TIERS, _tiers.tier_of


def test_every_test_file_sits_in_a_tier_folder():
    files = [p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts]
    assert len(files) > 100
    tiers = {tier_of(p) for p in files}
    assert tiers <= set(TIERS)
    assert {"unit", "integration", "distributed", "adversarial", "gpu"} <= tiers


def test_a_file_outside_the_tiers_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"tests/stray/test_x.py: a test file must sit in one of the tier folders"):
        tier_of(TESTS / "stray" / "test_x.py")
    with pytest.raises(ValueError, match="test_top.py"):
        tier_of(TESTS / "test_top.py")


def test_the_folder_sets_the_marker():
    """``-m unit`` selects this very file and ``-m integration`` does not (collection only, real pytest)."""
    def collected(marker: str) -> str:
        return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marker,
                               str(Path(__file__))], capture_output=True, text=True, cwd=TESTS.parent).stdout
    assert "test_the_folder_sets_the_marker" in collected("unit")
    assert "test_the_folder_sets_the_marker" not in collected("integration")
