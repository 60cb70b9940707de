"""Validate task directories: solvable, not yet solved, and leak-free.

    opencomposer tasks check tasks/ --sandbox namespace

For each task, through the grader agents get (``grading/grade.py``: a fresh sandbox of the
chosen backend each time): FAIL_TO_PASS tests fail and PASS_TO_PASS tests pass on the
workspace as given, the gold patch, carried as an agent's changes are, makes all of them
pass, and the leak probe (``tasks/leakage.leak_scan``) finds no distinctive line of the
deleted code anywhere the sandbox can read (workspace incl. git objects, the task's
environment, and the base interpreter's site-packages entries for the library).

Test: ``pytest tests/unit/tasks/test_factory.py tests/integration/test_tasks_pipeline.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.grading.carry import Carry
from opencomposer.grading.grade import grade, opener, patch_carry
from opencomposer.tasks.format import Task, TaskFormatError
from opencomposer.tasks.leakage import leak_scan


@dataclass
class CheckResult:
    task: str
    ok: bool = False
    problems: list[str] = field(default_factory=list)
    f2p: int = 0
    p2p: int = 0
    leak_channels: dict = field(default_factory=dict)
    leaks: int = 0
    seconds: float = 0.0


def check_task(path: Path, backend: str = "auto", leaks: bool = True) -> CheckResult:
    """``path`` graded at start and with its gold patch, and (``leaks``) probed for leaks. The task
    factory checks each task in its staging dir with ``leaks=False``: it ran the leak probe there first."""
    res = CheckResult(task=str(path))
    t0 = time.time()
    try:
        task = Task.load(path)
    except TaskFormatError as e:
        res.problems.append(str(e))
        return res
    t = task.meta.tests
    res.f2p, res.p2p = len(t.fail_to_pass), len(t.pass_to_pass)
    try:
        open_sandbox = opener(backend)
        start = grade(task, Carry(), open_sandbox).details
        already = [n for n, s in start["fail_to_pass"].items() if s in ("PASSED", "XFAIL")]
        broken = [n for n, s in start["pass_to_pass"].items() if s not in ("PASSED", "XFAIL")]
        if already:
            res.problems.append(f"FAIL_TO_PASS already passing at start: {already[:3]}")
        if broken:
            res.problems.append(f"PASS_TO_PASS failing at start: {broken[:3]}")
        # the gold patch is graded as an agent's work is: carried into a fresh sandbox
        carry = patch_carry(task, task.gold_patch, open_sandbox, str(task.root / "solution/gold.patch"))
        if carry.refused:
            res.problems.append(f"the grader does not carry the gold patch's {sorted(carry.refused)[:3]}: "
                                f"{next(iter(carry.refused.values()))}")
        gold = grade(task, carry, open_sandbox)
        if not gold.passed:
            bad = [n for d in ("fail_to_pass", "pass_to_pass") for n, s in gold.details[d].items()
                   if s not in ("PASSED", "XFAIL")]
            if bad or not gold.details.get("tampered"):
                res.problems.append(f"gold patch leaves tests failing: {bad[:3]} {gold.details['report']}")
            else:  # every test passes, yet the grader voids the run: no agent could earn this task's reward
                res.problems.append(f"the grader voids the gold patch's run (its tests pass): {gold.details['tampered']}")
    except Exception as e:  # a task that crashes the checker is a failed check, not a crash
        res.problems.append(f"{type(e).__name__}: {e}")
    res.leak_channels, suspects = leak_scan(task) if leaks else ({}, {})
    res.leaks = len(suspects)
    if suspects:
        where, found = next(iter(suspects.items()))
        res.problems.append(f"leak: {where} holds {len(found)} deleted lines, e.g. {sorted(found)[0]!r}")
    res.ok = not res.problems
    res.seconds = round(time.time() - t0, 2)
    return res


def staged_check(backend: str) -> Callable[[Path], CheckResult]:
    """The task factory's last check of each task it stages (``tasks/make.py``): the grader, in
    ``backend``, gives the start no reward and the gold patch the reward (the factory ran the
    leak probe there just before)."""
    return lambda task_dir: check_task(task_dir, backend, leaks=False)
