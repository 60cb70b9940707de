"""Reading pytest's -rA summary into per-test outcomes, and running it in a real sandbox."""

import sys
from pathlib import Path

from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks.testrun import parse_outcomes, run_tests

SUMMARY = """\
..F
=========================== short test summary info ============================
PASSED tests/test_a.py::test_one
PASSED tests/test_a.py::TestK::test_two[a - b]
FAILED tests/test_a.py::test_three - AssertionError: expected 2, got 1
ERROR tests/test_b.py - ModuleNotFoundError: No module named 'x'
XFAIL tests/test_a.py::test_x - reason
1 failed, 2 passed, 1 error in 0.1s
"""


def test_parse_outcomes():
    o = parse_outcomes(SUMMARY)
    assert o == {
        "tests/test_a.py::test_one": "PASSED",
        "tests/test_a.py::TestK::test_two[a - b]": "PASSED",
        "tests/test_a.py::test_three": "FAILED",
        "tests/test_b.py": "ERROR",
        "tests/test_a.py::test_x": "XFAIL",
    }


def test_run_tests_in_sandbox(tmp_path: Path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_m.py").write_text(
        "def test_ok():\n    assert sum([1, 2]) == 3\n\ndef test_bad():\n    assert sum([1, 2]) == 4\n")
    env = Path(sys.prefix)  # this venv has pytest
    with make_sandbox(SandboxSpec(tmp_path, env), "local") as sb:
        rep = run_tests(sb, ["tests/test_m.py"], timeout=120)
        assert rep.outcomes == {"tests/test_m.py::test_ok": "PASSED", "tests/test_m.py::test_bad": "FAILED"}
        assert rep.passed() == {"tests/test_m.py::test_ok"} and rep.exit_code == 1
        assert sb.exec("ls -a tests").output.count("pycache") == 0  # no bytecode left to leak
