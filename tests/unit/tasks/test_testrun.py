"""The factory's test runs go through the grader's launcher: the same outcome for a test at task-making
and at grading time, whatever the suite prints; run in a real (local) sandbox with this venv's pytest."""

import sys
from pathlib import Path

from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks.testrun import DEFAULT_COMMAND, PytestRun, run_tests

SUITE = {
    "tests/test_m.py": (
        "import pytest, unittest\n"
        "def test_ok():\n    assert sum([1, 2]) == 3\n\n"
        "def test_bad():\n    print('PASSED tests/test_m.py::test_bad')\n    assert sum([1, 2]) == 4\n\n"
        "@pytest.mark.skip(reason='not here')\ndef test_skipped():\n    pass\n\n"
        "@pytest.mark.xfail(strict=True)\ndef test_known_bug():\n    assert 0\n\n"
        "def test_imperative_xfail():\n    pytest.xfail('gave up')\n\n"
        "class K(unittest.TestCase):\n"
        "    def test_sub(self):\n"
        "        for i in range(3):\n"
        "            with self.subTest(i=i):\n"
        "                self.assertLess(i, 2)\n"),
    "tests/test_broken.py": "import no_such_module_here\n",
}


def test_run_tests_reads_the_launchers_report_in_a_sandbox(tmp_path: Path):
    for rel, text in SUITE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    env = Path(sys.prefix)  # this venv has pytest
    with make_sandbox(SandboxSpec(tmp_path, env), "local") as sb:
        rep = run_tests(sb, ["tests/test_m.py"], timeout=120)
        assert rep.problem == "" and rep.collect_errors == []
        assert rep.outcomes == {
            "tests/test_m.py::test_ok": "PASSED",
            "tests/test_m.py::test_bad": "FAILED",  # its printed "PASSED" line counts for nothing
            "tests/test_m.py::test_skipped": "SKIPPED",
            "tests/test_m.py::test_known_bug": "XFAIL",  # marked before it ran
            "tests/test_m.py::test_imperative_xfail": "FAILED",  # xfail() from inside the test: a failure
            "tests/test_m.py::K::test_sub": "FAILED",  # a failed subtest fails its test
        }
        assert rep.passed() == {"tests/test_m.py::test_ok", "tests/test_m.py::test_known_bug"} and rep.exit_code == 1
        # a module that does not collect: ERROR under its path, as pytest's summary names it (pytest then
        # runs nothing: the factory's install step finds such modules so and leaves them out)
        broken = run_tests(sb, ["tests/test_broken.py", "tests/test_m.py"], timeout=120)
        assert broken.outcomes == {"tests/test_broken.py": "ERROR"} and broken.collect_errors == ["tests/test_broken.py"]
        assert broken.exit_code == 2 and "error during collection" in broken.output_tail
        assert sb.exec("ls -a tests").output.count("pycache") == 0  # no bytecode left to leak
        # the grader's run of the same tests (what it adds: watched files, the agent's files) agrees
        graded = PytestRun.from_command(DEFAULT_COMMAND, ["tests/test_m.py"], watched=["tests/test_m.py"],
                                        carried=[]).execute(sb, timeout=120)
        assert graded.outcomes == rep.outcomes


def test_a_run_that_times_out_has_no_outcomes_and_says_why(tmp_path: Path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_slow.py").write_text("import time\ndef test_slow():\n    time.sleep(30)\n")
    with make_sandbox(SandboxSpec(tmp_path, Path(sys.prefix)), "local") as sb:
        rep = run_tests(sb, ["tests/test_slow.py"], timeout=3)
    assert rep.timed_out and rep.outcomes == {} and rep.passed() == set() and "no report" in rep.problem
