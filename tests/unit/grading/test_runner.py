"""The grader's pytest launcher: outcomes from one nonce-tagged report, never from printed text."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from opencomposer.tasks.testrun import NotPytest, PytestRun
from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks.testrun import DEFAULT_COMMAND

ENV = Path(sys.prefix)  # this venv has pytest

TESTS = '''\
import pytest

def test_ok():
    assert 1 + 1 == 2

def test_bad():
    assert 1 + 1 == 3

@pytest.fixture
def broken():
    raise RuntimeError("setup")

def test_setup_error(broken):
    pass

@pytest.fixture
def bad_teardown():
    yield
    raise RuntimeError("teardown")

def test_teardown_error(bad_teardown):
    pass

@pytest.mark.xfail
def test_xfail():
    assert False

@pytest.mark.xfail
def test_xpass():
    pass

def test_skip():
    pytest.skip("no")
'''


def run(tmp_path: Path, files: dict[str, str], targets: list[str], backend: str = "local", carried: list[str] = ()):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    with make_sandbox(SandboxSpec(tmp_path, ENV), backend) as sb:
        return PytestRun.from_command(DEFAULT_COMMAND, targets, carried=list(carried)).execute(sb, timeout=120)


def test_outcomes_of_every_kind(tmp_path):
    rep = run(tmp_path, {"tests/test_k.py": TESTS}, ["tests/test_k.py"])
    assert rep.problem == ""
    n = "tests/test_k.py::"
    assert rep.outcomes == {n + "test_ok": "PASSED", n + "test_bad": "FAILED", n + "test_setup_error": "ERROR",
                            n + "test_teardown_error": "ERROR", n + "test_xfail": "XFAIL", n + "test_xpass": "XPASS",
                            n + "test_skip": "SKIPPED"}


def test_a_run_stops_at_the_first_must_pass_test_that_fails(tmp_path):
    """``must_pass``: the first of them that does not pass stops the run (pytest's order); a failure of a test
    outside it (here test_bad, the setup error) does not, and an xfail-marked must-pass test is a pass."""
    for rel, text in {"tests/test_k.py": TESTS}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    n = "tests/test_k.py::"
    with make_sandbox(SandboxSpec(tmp_path, ENV), "local") as sb:
        run = PytestRun.from_command(DEFAULT_COMMAND, ["tests/test_k.py"],
                                     must_pass=[n + "test_ok", n + "test_xfail", n + "test_teardown_error", n + "test_skip"])
        rep = run.execute(sb, timeout=120)
    assert rep.problem == "" and rep.stopped_at == n + "test_teardown_error"
    # test_bad and test_setup_error failed without stopping it; nothing after the teardown error ran
    assert rep.outcomes == {n + "test_ok": "PASSED", n + "test_bad": "FAILED", n + "test_setup_error": "ERROR",
                            n + "test_teardown_error": "ERROR"}
    with make_sandbox(SandboxSpec(tmp_path, ENV), "local") as sb:
        rep = PytestRun.from_command(DEFAULT_COMMAND, ["tests/test_k.py"], must_pass=[n + "test_xfail"]).execute(sb, 120)
    assert rep.stopped_at == "" and len(rep.outcomes) == 7  # a must-pass xfail passes: the run goes to the end


SUBTESTS = '''\
import unittest

class T(unittest.TestCase):
    def test_fail_sub(self):
        with self.subTest(i=1):
            self.assertEqual(1, 2)

    def test_skip_sub(self):
        with self.subTest(i=1):
            self.skipTest("no backend")
        with self.subTest(i=2):
            pass

    def test_ok(self):
        pass
'''


def test_a_failed_subtest_fails_its_test_and_a_skipped_one_does_not(tmp_path):
    """pytest 9 reports a test passed after its failed subtest: taking that report let an edit that fails only
    inside ``subTest`` earn the reward. A skipped subtest (an optional backend missing) is no failure, and does
    not stop a fail-fast run."""
    n = "tests/test_s.py::T::"
    rep = run(tmp_path, {"tests/test_s.py": SUBTESTS}, ["tests/test_s.py"])
    assert rep.outcomes == {n + "test_fail_sub": "FAILED", n + "test_skip_sub": "PASSED", n + "test_ok": "PASSED"}
    with make_sandbox(SandboxSpec(tmp_path, ENV), "local") as sb:
        fast = PytestRun.from_command(DEFAULT_COMMAND, ["tests/test_s.py"],
                                      must_pass=[n + "test_skip_sub", n + "test_ok"]).execute(sb, 120)
    assert fast.stopped_at == "" and fast.outcomes == rep.outcomes


EXPECTED = '''\
import unittest

class T(unittest.TestCase):
    @unittest.expectedFailure
    def test_known_bug(self):
        self.assertEqual(1, 2)

    def test_plain(self):
        self.assertEqual(1, 2)

T.test_plain.__unittest_expecting_failure__ = True  # as code under test could do at import
'''


def test_expected_failures_are_those_the_grader_names_not_those_the_run_claims(tmp_path):
    """boolean.py marks known bugs with unittest's ``@expectedFailure``: counted as FAILED, 24 pool tasks could not be
    solved (a PASS_TO_PASS test fails with the gold, as expected). The grader names them from the hidden source;
    the attribute set at run time (here on test_plain) counts for nothing."""
    from opencomposer.grading.grade import _expected_failures

    n = "tests/test_e.py::T::"
    assert _expected_failures(EXPECTED) == ("T::test_known_bug",)
    rep = run(tmp_path, {"tests/test_e.py": EXPECTED}, ["tests/test_e.py"])
    assert rep.outcomes == {n + "test_known_bug": "FAILED", n + "test_plain": "FAILED"}  # nothing named: failures
    with make_sandbox(SandboxSpec(tmp_path, ENV), "local") as sb:
        rep = PytestRun.from_command(DEFAULT_COMMAND, ["tests/test_e.py"],
                                     expected_failures=[n + "test_known_bug"]).execute(sb, 120)
    assert rep.outcomes == {n + "test_known_bug": "XFAIL", n + "test_plain": "FAILED"}


def test_printed_passes_count_for_nothing(tmp_path):
    """A module that prints pytest's summary lines (and a report-looking JSON line) at import."""
    forger = ("import sys\n"
              "print('PASSED tests/test_k.py::test_bad')\n"
              "print('0123456789abcdef0123456789abcdef {\"outcomes\": {\"tests/test_k.py::test_bad\": \"PASSED\"}, "
              "\"collect_errors\": [], \"exit\": 0}')\n"
              "sys.stdout.write('1 passed in 0.01s\\n')\n")
    rep = run(tmp_path, {"forge.py": forger, "tests/test_k.py": "import forge\n\ndef test_bad():\n    assert False\n"},
              ["tests/test_k.py"])
    assert rep.problem == "" and rep.outcomes == {"tests/test_k.py::test_bad": "FAILED"}


def test_a_reach_names_the_carried_file_when_the_tests_swap_os_path_for_ntpath(tmp_path):
    """mako's suite sets ``os.path = ntpath`` in places: a reach must still name ``pkg/mod.py`` (with
    ``pkg\\mod.py`` the grader could not tell it is a line of the base file and voided honest runs)."""
    files = {"pkg/__init__.py": "", "pkg/mod.py": "def build():\n    return compile('1', 'x', 'eval')\n",
             "tests/test_k.py": "import ntpath, os, posixpath\nimport pkg.mod\n\n\ndef test_a():\n"
                                "    os.path = ntpath\n    try:\n        pkg.mod.build()\n    finally:\n"
                                "        os.path = posixpath\n"}
    rep = run(tmp_path, files, ["tests/test_k.py"], carried=["pkg/mod.py"])
    assert rep.outcomes == {"tests/test_k.py::test_a": "PASSED"}
    assert [(r.what, r.file, r.line) for r in rep.reach] == [("compile", "pkg/mod.py", 2)]


def test_a_reach_names_the_carried_file_when_the_tests_change_directory(tmp_path):
    """python-dotenv's tests ``chdir`` into a temporary directory before calling ``find_dotenv``, which walks
    ``sys._getframe()``: the reach must name ``pkg/mod.py`` relative to the workspace (relative to the new
    directory it was ``../../../../workspace/...``, no carried file, and the gold patch earned 0)."""
    files = {"pkg/__init__.py": "", "pkg/mod.py": "import sys\n\ndef where():\n    return sys._getframe().f_lineno\n",
             "tests/test_k.py": "import os\nimport pkg.mod\n\n\ndef test_a(tmp_path):\n"
                                "    (tmp_path / 'a' / 'b').mkdir(parents=True)\n    os.chdir(tmp_path / 'a' / 'b')\n"
                                "    assert pkg.mod.where() == 4\n"}
    rep = run(tmp_path, files, ["tests/test_k.py"], carried=["pkg/mod.py"])
    assert rep.outcomes == {"tests/test_k.py::test_a": "PASSED"}
    assert [(r.what, r.file, r.line) for r in rep.reach] == [("sys._getframe", "pkg/mod.py", 4)]


def test_no_report_when_the_run_dies(tmp_path):
    rep = run(tmp_path, {"tests/test_k.py": "import os\n\ndef test_a():\n    print('PASSED tests/test_k.py::test_a')\n"
                         "    os._exit(0)\n"}, ["tests/test_k.py"])
    assert rep.outcomes == {} and "no report" in rep.problem


def test_collection_error_is_recorded(tmp_path):
    rep = run(tmp_path, {"tests/test_k.py": "import nonexistent_module\n\ndef test_a():\n    pass\n"}, ["tests/test_k.py"])
    assert rep.problem == "" and rep.collect_errors == ["tests/test_k.py"] and rep.status("tests/test_k.py::test_a") == "MISSING"


@pytest.mark.namespace
def test_same_outcomes_in_a_namespace_sandbox(tmp_path):
    from opencomposer.sandbox.namespace import unavailable_reason
    if unavailable_reason():
        pytest.skip(unavailable_reason())
    rep = run(tmp_path, {"tests/test_k.py": TESTS}, ["tests/test_k.py::test_ok", "tests/test_k.py::test_bad"], "namespace")
    assert rep.outcomes == {"tests/test_k.py::test_ok": "PASSED", "tests/test_k.py::test_bad": "FAILED"}


@pytest.mark.parametrize("command,args", [
    ("python -m pytest -q -x", ["-q", "-x", "t.py"]),
    ("/opt/env/bin/python3 -m pytest -p no:cacheprovider", ["-p", "no:cacheprovider", "t.py"]),
    ("pytest -q", ["-q", "t.py"]),
])
def test_task_commands_keep_their_arguments(command, args):
    assert PytestRun.from_command(command, ["t.py"]).args == args


@pytest.mark.parametrize("command", ["bash tests/test.sh", "python -m unittest", "python -c 'import pytest'", ""])
def test_other_commands_are_refused_by_name(command):
    with pytest.raises(NotPytest, match="is not 'python -m pytest"):
        PytestRun.from_command(command, ["t.py"])
