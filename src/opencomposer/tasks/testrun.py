"""Run pytest inside a sandbox and read per-test outcomes from a report the code under test cannot forge.

One runner for everyone who needs test outcomes: the task factory (the library's own suite at the
original and at each deletion: ``run_tests``) and the grader (the hidden tests on the agent's code:
``PytestRun`` with the files to watch, the agent's files, the tests that must pass). So a test's
outcome is decided the same way when a task is made and when it is graded (session 34 found the
factory's old reading of pytest's ``-rA`` summary and the grader's recorder disagreeing on
unittest's ``@expectedFailure`` and on failed subtests).

    report = run_tests(sandbox, ["tests/test_x.py"], timeout=300)      # the factory
    run = PytestRun.from_command(task.meta.tests.command, targets, watched=..., carried=...)
    report = run.execute(sandbox, timeout=300)                          # the grader (grading/grade.py)
    report.outcomes     # {"tests/test_x.py::test_a": "PASSED", ...}
    report.problem      # "" or why the report cannot be trusted ("no report", "two reports")

``DEFAULT_COMMAND`` is the test command tasks record (``task.toml``, Harbor's ``tests/test.sh``):
``python -m pytest`` with fixed options (no cache provider, so no ``.pytest_cache`` is left to
leak; the project's ``addopts`` cleared, since coverage or benchmark flags need plugins we may not
have; ``-rA`` for a person reading the output). The launcher keeps a command's arguments and
replaces only the interpreter start.

pytest runs in-process under a small launcher (``BOOT``, passed with ``python -c``) that
registers a recorder plugin and, after the run, writes one line: a per-run random nonce
followed by the outcomes as JSON, through a copy of stdout taken before any test code
ran. The nonce reaches the launcher on stdin (not argv or the environment, which the code
under test could read from ``/proc/self``), and stdin is closed before pytest starts. So
``PASSED ...`` lines, a fake summary or a JSON file printed or written by the code under
test count for nothing; only the nonce line does, and a run that prints it twice is
refused as tampered with.

The launcher also hashes the ``watched`` files (the hidden tests, the canary, every
``conftest.py``) before pytest starts, after collection and after the run: code under test
that rewrites a test file on disk while the tests are being imported is reported in
``changed``, and the grader refuses the run.

Before pytest is imported the launcher installs an audit hook (``sys.addaudithook``: it
cannot be removed). It writes a ``REACH`` line on the nonce channel at once, so nothing done
later can take it back, for every write to a watched file and for every frame, ``gc``,
``exec``/``compile``, ``ctypes``, tracing, signal or process call made from a file the agent
carried (``carried``); the grader drops those made from lines of the base file or the gold
patch (``grade.honest_line``). The launcher binds ``os.write`` and the path functions it uses before any test code runs (a
test suite that swaps ``os.path`` for ``ntpath``, as mako's does, must not turn a carried file's
``pkg/mod.py`` into ``pkg\\mod.py``, which no longer names the carried file) and names a reach's file
relative to the workspace root, not to the current directory (python-dotenv's tests ``chdir`` into a temporary
directory: ``../../../../workspace/src/dotenv/main.py`` named no carried file either), always
exits 0 after its report (another status is refused), and counts XFAIL only for tests with an
xfail marker (an imperative ``pytest.xfail()`` from the code under test is a failure).

What this cannot stop by construction: code under test runs inside the same interpreter as
pytest, so an in-process forgery that raises no audited event and spares the canary (a copy
of one of the task's own tests, ``grade.py``) is not ruled out; the monitors scan the carried
code for the known forms (``rewards/monitors.py``); the README says so.

XFAIL counts only for tests marked so before they run: pytest's ``xfail`` marker, or ``expected_failures``, the
tests the hidden files' source decorates with unittest's ``@expectedFailure`` (read there by the grader, on the
host: the attribute the decorator sets could be set by code under test too, on tests a canary does not share).

A subtest that fails (``unittest``'s ``subTest``, pytest's ``subtests``) fails its test: pytest 9 reports the
test itself passed after a failed subtest, and taking that last report let an edit that fails only inside
``subTest`` blocks earn the reward. Skipped and passed subtests leave the test as its own reports have it.

``must_pass`` (the task's FAIL_TO_PASS and PASS_TO_PASS tests, ``[agent] grade_fail_fast``): the recorder stops
the session at the first of them that does not pass, in pytest's own order (``stopped_at`` names it); the reward
is 0 from there, so only time is saved. Code under test can make the run stop sooner (its tests are then missing:
no reward) or keep it going (as without the option), never earn a reward by it.

The command must be pytest's (``python -m pytest ARGS`` or ``pytest ARGS``, as every task
source writes); its arguments are kept, and the launcher replaces the interpreter start.

Test: ``pytest tests/unit/grading/test_runner.py tests/unit/tasks/test_testrun.py``.
"""

from __future__ import annotations

import json
import secrets
import shlex
from dataclasses import dataclass, field

from opencomposer.protocols import Sandbox

PYTEST_ARGS = ["-p", "no:cacheprovider", "-o", "addopts=", "-rA", "--tb=no", "-q",
               "--color=no", "-W", "ignore::DeprecationWarning"]
DEFAULT_COMMAND = "python -m pytest " + " ".join(shlex.quote(a) for a in PYTEST_ARGS)


@dataclass
class TestReport:
    __test__ = False
    outcomes: dict[str, str] = field(default_factory=dict)  # node id -> PASSED/FAILED/ERROR/SKIPPED/XFAIL/XPASS
    exit_code: int = 0
    timed_out: bool = False
    output_tail: str = ""
    seconds: float = 0.0

    def passed(self) -> set[str]:
        return {t for t, o in self.outcomes.items() if o in ("PASSED", "XFAIL")}

    def status(self, node_id: str) -> str:
        return self.outcomes.get(node_id, "MISSING")

# The launcher. Outcomes per test id: the worst phase wins (an error in setup or teardown is
# ERROR, a failed call FAILED); xfail/xpass as pytest's own summary names them.
BOOT = r"""
import hashlib, json, os, sys
def _oc_main():
    nonce = sys.stdin.readline().strip()
    watched = json.loads(sys.stdin.readline())
    carried = json.loads(sys.stdin.readline())
    must_pass = set(json.loads(sys.stdin.readline()))
    expected = set(json.loads(sys.stdin.readline()))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    channel, write, dumps, real, relpath = os.dup(1), os.write, json.dumps, os.path.realpath, os.path.relpath
    getframe, fspath = sys._getframe, os.fspath
    root = real(os.getcwd())
    watched_real = {real(p) for p in watched}
    carried_real = {real(p) for p in carried}
    stdlib = os.path.dirname(os.__file__)
    inside = [False]
    files = {}
    def is_carried(filename):
        r = files.get(filename)
        if r is None:
            r = files[filename] = real(filename) in carried_real
        return r
    def say(kind, what, where=None):
        d = {"kind": kind, "what": what, "file": where[0] if where else "", "line": where[1] if where else 0}
        write(channel, ("\n" + nonce + " REACH " + dumps(d) + "\n").encode())
    def culprit(walk):
        f = getframe(2)
        if not walk and f.f_code.co_filename.startswith(stdlib) and f.f_code.co_name in ("currentframe", "stack", "trace"):
            f = f.f_back
        while walk and f is not None and f.f_code.co_filename.startswith(stdlib):
            f = f.f_back
        if f is not None and is_carried(f.f_code.co_filename):
            return (relpath(real(f.f_code.co_filename), root), f.f_lineno)
        return None
    FRAMES = {"sys._getframe", "sys._current_frames", "object.__getattr__", "gc.get_objects", "gc.get_referrers",
              "gc.get_referents", "exec", "compile", "sys.settrace", "sys.setprofile", "sys.addaudithook"}
    PROCESSES = {"os.kill", "os.killpg", "os.system", "subprocess.Popen", "os.posix_spawn", "os.exec", "os.fork",
                 "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function"}
    WRITES = {"os.rename", "os.remove", "os.rmdir", "os.truncate", "os.chmod", "os.link", "os.symlink", "os.utime",
              "shutil.rmtree", "shutil.move"}
    def hook(event, args):
        if inside[0]:
            return
        inside[0] = True
        try:
            if event == "open":
                path, mode, flags = args
                if isinstance(path, (str, bytes)) and ((isinstance(mode, str) and any(c in mode for c in "wax+"))
                                                       or (isinstance(flags, int) and flags & 3)):
                    p = real(fspath(path) if isinstance(path, str) else os.fsdecode(path))
                    if p in watched_real:
                        say("writes a test file", p)
            elif event in WRITES:
                for a in args:
                    if isinstance(a, (str, bytes)) and real(fspath(a) if isinstance(a, str) else os.fsdecode(a)) in watched_real:
                        say("changes a test file", event + " " + str(a))
            elif event in FRAMES or event in PROCESSES:
                if event == "object.__getattr__" and args[1] not in ("tb_frame", "gi_frame", "cr_frame", "ag_frame", "__code__"):
                    return
                where = culprit(event in PROCESSES)
                if where is not None:
                    say("code under test reaches for the runner", event, where)
        except Exception:
            pass
        finally:
            inside[0] = False
    if watched or carried:  # (the factory's runs of a library's own suite watch nothing)
        sys.addaudithook(hook)
    def digest():
        out = {}
        for p in watched:
            try:
                with open(p, "rb") as f: out[p] = hashlib.sha256(f.read()).hexdigest()
            except OSError: out[p] = None
        return out
    before, changed = digest(), set()
    import pytest
    outcomes, collect_errors, xfail_marked, running, sub_failed, stopped = {}, [], set(), [], set(), []
    class _Recorder:
        def pytest_collectreport(self, report):
            if report.failed:
                collect_errors.append(report.nodeid)
        def pytest_collection_finish(self, session):
            xfail_marked.update(i.nodeid for i in session.items
                                if i.get_closest_marker("xfail") is not None or i.nodeid in expected)
            changed.update(p for p, h in digest().items() if h != before[p])
            running.append(session)
        def pytest_runtest_logreport(self, report):
            xf = hasattr(report, "wasxfail") and report.nodeid in xfail_marked  # an imperative xfail() is a failure
            if type(report).__name__ in ("SubtestReport", "SubTestReport"):  # pytest >= 9, or pytest-subtests
                # a failed subtest fails its test, whatever the test's own report says after it (pytest reports
                # the test passed); a skipped or passed one leaves the test as its own reports have it
                if report.failed and report.nodeid not in xfail_marked:
                    outcomes[report.nodeid] = "FAILED"
                    sub_failed.add(report.nodeid)
            elif report.nodeid in sub_failed and report.when == "call":
                pass  # a subtest failed: the test stays FAILED (an error in teardown may still make it ERROR)
            elif report.when == "setup":
                if report.failed: outcomes[report.nodeid] = "ERROR"
                elif report.skipped: outcomes[report.nodeid] = "XFAIL" if xf else "SKIPPED"
            elif report.when == "call":
                if report.failed: outcomes[report.nodeid] = "FAILED"
                elif report.skipped: outcomes[report.nodeid] = "XFAIL" if xf else "FAILED" if hasattr(report, "wasxfail") else "SKIPPED"
                else: outcomes[report.nodeid] = "XPASS" if hasattr(report, "wasxfail") else "PASSED"
            elif report.failed:
                outcomes[report.nodeid] = "ERROR"
            if report.nodeid in must_pass and outcomes.get(report.nodeid, "PASSED") not in ("PASSED", "XFAIL") and running:
                running[0].shouldstop = "a test that must pass did not: " + report.nodeid
                stopped.append(report.nodeid)
    code = pytest.main(sys.argv[1:], plugins=[_Recorder()])
    changed.update(p for p, h in digest().items() if h != before[p])
    for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try: s.flush()
        except Exception: pass
    report = {"outcomes": outcomes, "collect_errors": collect_errors, "exit": int(code), "changed": sorted(changed),
              "stopped_at": stopped[0] if stopped else ""}
    write(channel, ("\n" + nonce + " " + dumps(report) + "\n").encode())
    os._exit(0)
_oc_main()
"""


@dataclass
class Reach:
    """One thing the launcher's audit hook saw: a test file written, or the code under test (``file``,
    ``line``: a carried file, workspace-relative) reaching for frames, the collector, code or processes."""

    kind: str
    what: str
    file: str = ""
    line: int = 0

    def __str__(self) -> str:
        return f"{self.kind}: {self.what}" + (f" at {self.file}:{self.line}" if self.file else "")


class NotPytest(ValueError):
    """A task's test command that the grader cannot run under its launcher."""


@dataclass
class GradedRun(TestReport):
    __test__ = False
    problem: str = ""  # why the outcomes cannot be trusted ("" when they can)
    collect_errors: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  # watched files whose bytes changed during the run
    reach: list[Reach] = field(default_factory=list)  # what the launcher's audit hook saw the code under test do
    stopped_at: str = ""  # the must-pass test that failed and stopped the run ("": it ran to the end)


@dataclass
class PytestRun:
    args: list[str]  # pytest's arguments: the task command's, then the targets
    python: str = "python"
    watched: list[str] = field(default_factory=list)  # workspace files that must not change during the run
    carried: list[str] = field(default_factory=list)  # the agent's files: the code the audit hook watches
    # tests that must pass for any reward: the run stops at the first that does not (the reward is 0 whatever
    # the rest do); empty: every target runs
    must_pass: list[str] = field(default_factory=list)
    # tests the hidden files' source marks with unittest's @expectedFailure (read on the host, ``grade.py``): XFAIL
    # counts for them as for pytest's xfail marker; never read from the run, where code under test could set it
    expected_failures: list[str] = field(default_factory=list)

    @classmethod
    def from_command(cls, command: str, targets: list[str], python: str = "python",
                     watched: list[str] | None = None, carried: list[str] | None = None,
                     must_pass: list[str] | None = None, expected_failures: list[str] | None = None) -> PytestRun:
        argv = shlex.split(command)
        if len(argv) >= 3 and argv[0].split("/")[-1].startswith("python") and argv[1:3] == ["-m", "pytest"]:
            rest = argv[3:]
        elif argv and argv[0].split("/")[-1] in ("pytest", "py.test"):
            rest = argv[1:]
        else:
            raise NotPytest(f"test command {command!r} is not 'python -m pytest ...' or 'pytest ...'; "
                            "the grader runs pytest under its own launcher")
        return cls(rest + list(targets), python, list(watched or []), list(carried or []), list(must_pass or []),
                   list(expected_failures or []))

    def execute(self, sandbox: Sandbox, timeout: float) -> GradedRun:
        nonce = secrets.token_hex(16)
        feed = "\n".join([nonce, json.dumps(self.watched), json.dumps(self.carried), json.dumps(self.must_pass),
                          json.dumps(self.expected_failures)]) + "\n"
        r = sandbox.exec([self.python, "-c", BOOT, *self.args], timeout=timeout, max_output=4_000_000,
                         stdin=feed.encode())
        lines = [line[len(nonce) + 1:] for line in r.output.splitlines() if line.startswith(nonce + " ")]
        reports = [x for x in lines if not x.startswith("REACH ")]
        run = GradedRun(exit_code=r.exit_code, timed_out=r.timed_out, output_tail=r.output[-4000:], seconds=r.seconds)
        for x in lines:
            if x.startswith("REACH "):
                try:
                    d = json.loads(x[6:])
                    run.reach.append(Reach(str(d["kind"]), str(d["what"]), str(d["file"]), int(d["line"])))
                except (ValueError, KeyError, TypeError):
                    run.reach.append(Reach("an unreadable finding", x[6:200]))
        if len(reports) != 1:
            run.problem = ("no report from the test run (it crashed, was killed or timed out)" if not reports
                           else f"{len(reports)} reports from one test run: the code under test forged one")
            return run
        if r.truncated:  # pytest captures what tests print: this much came around it
            run.problem = "the test run wrote more than the output cap around pytest's capture: not trusted"
            return run
        if r.exit_code != 0:  # the launcher always exits 0 after its report
            run.problem = f"the launcher exited {r.exit_code} after its report: something ended it early"
            return run
        try:
            data = json.loads(reports[0])
            run.outcomes = {str(k): str(v) for k, v in data["outcomes"].items()}
            run.collect_errors = [str(x) for x in data["collect_errors"]]
            run.exit_code = int(data["exit"])
            run.changed = [str(x) for x in data["changed"]]
            run.stopped_at = str(data["stopped_at"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            run.problem = f"unreadable report ({type(e).__name__})"
        return run


def run_tests(sandbox: Sandbox, targets: list[str], command: str = DEFAULT_COMMAND,
              timeout: float = 300.0) -> GradedRun:
    """Run the pytest ``command`` on ``targets`` (files or node ids) in the sandbox's workspace, under
    the launcher, watching nothing: the factory's runs of a library's own tests. A module that fails
    to collect is an ``ERROR`` outcome under its path, as pytest's summary names it."""
    run = PytestRun.from_command(command, targets).execute(sandbox, timeout)
    for node in run.collect_errors:
        run.outcomes.setdefault(node, "ERROR")
    return run
