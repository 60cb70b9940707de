"""The test reward: hidden tests copied in after submit, run in the sandbox, all-or-nothing.

``grade(task, sandbox)`` writes every file of ``TASK/tests/files/`` over the workspace
(overriding whatever the agent did to test files, and adding the hidden ones), runs the
task's test targets, and returns reward 1.0 only when every FAIL_TO_PASS and
PASS_TO_PASS test passes, with the per-test outcomes in ``details``.

Test: ``pytest tests/unit/test_rewards.py``.
"""

from __future__ import annotations

from opencomposer.protocols import RewardResult, Sandbox
from opencomposer.tasks.format import Task
from opencomposer.tasks.testrun import run_tests


def install_hidden_tests(task: Task, sandbox: Sandbox) -> list[str]:
    """Copy the hidden test files into the sandbox workspace; returns their paths."""
    written = []
    for f in sorted(task.hidden_tests.rglob("*")):
        if f.is_file():
            rel = f.relative_to(task.hidden_tests).as_posix()
            sandbox.write_file(rel, f.read_bytes())
            written.append(rel)
    return written


def grade(task: Task, sandbox: Sandbox) -> RewardResult:
    install_hidden_tests(task, sandbox)
    t = task.meta.tests
    rep = run_tests(sandbox, t.targets, t.command, timeout=t.timeout)
    f2p = {n: rep.status(n) for n in t.fail_to_pass}
    p2p = {n: rep.status(n) for n in t.pass_to_pass}
    ok = lambda d: sum(v in ("PASSED", "XFAIL") for v in d.values())  # noqa: E731
    passed = ok(f2p) == len(f2p) and ok(p2p) == len(p2p) and not rep.timed_out
    return RewardResult(
        reward=1.0 if passed else 0.0,
        passed=passed,
        details={
            "fail_to_pass": f2p, "pass_to_pass": p2p,
            "f2p_passed": ok(f2p), "p2p_passed": ok(p2p),
            "timed_out": rep.timed_out, "exit_code": rep.exit_code, "seconds": round(rep.seconds, 2),
            "output_tail": rep.output_tail[-1500:] if not passed else "",
        },
    )
