"""Turn a real library into validated feature-deletion tasks: the driver of ``tasks make``.

    opencomposer tasks make --source pypi:more-itertools==10.5.0 --out tasks/ --max 50
    report = make_tasks("pypi:more-itertools==10.5.0", Path("tasks/"), max_tasks=50)

Steps, each in its own module: prepare the source (``prepare.prepare_source``: fetch,
install, three baseline runs that expose flaky tests, the coverage map) -> draw (candidate,
level) jobs, levels weighted as asked (``jobs.draw_jobs``) -> for each, delete in a sandbox and
rerun the tests that execute or mention it (``validate``) -> keep it when some tests fail
(FAIL_TO_PASS) and the rest still pass (PASS_TO_PASS) -> write the task directory
(``emit.write_task``) atomically, scrubbed of every leak channel, after the full leak probe
found nothing and, given ``check`` (``grading.check.check_task``; every CLI path passes it), after
the grader gave the staged task no reward at start and the reward with its gold patch; a
flagged or rejected candidate is never written. ``make_tasks`` runs the
jobs on ``workers`` threads, one sandbox each, and keeps the count under ``max_tasks``.

Validation order (the cheap way that keeps every guarantee): a ``function`` or ``class``
deletion first gets an import probe (``python -c "import the.module"``): one that breaks the
library's import fails every test, so it is rejected without a test run. The tests a
candidate selects are expected to pass as they did in all three baseline runs, so the
deletion is run first;
only a candidate that then looks like a task (some selected tests fail, some still pass)
pays for a second run of the same tests on the original tree, which confirms that every
FAIL_TO_PASS and PASS_TO_PASS test passes there when run on its own.

Resumable: the prepared state is cached beside the environment (``prepare.py``), and every
candidate tried is appended to ``OUT/_journal/<slug>.jsonl`` with its outcome (``jobs.Journal``);
a rerun of the same command skips what was tried and counts what was made towards ``max_tasks``.

Killed at any moment, a rerun yields each task once: a task is built in a staging dir and
renamed into place whole (``emit.py``); no reader lists a ``.`` dir (``format.task_dirs``), and
the next run removes the staging dirs of dead runs (``paths.remove_stale_temps``). A task
renamed into place by a run killed before its journal line is found on disk by the rerun and
counted, not made again.

Test: ``pytest tests/integration/test_tasks_pipeline.py tests/integration/test_tasks_make_killed.py tests/unit/tasks``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.paths import remove_stale_temps
from opencomposer.protocols import Policy
from opencomposer.tasks import deletion
from opencomposer.tasks.coverage import item_of
from opencomposer.tasks.emit import GraderRejects, LeakFound, task_id, write_task
from opencomposer.tasks.format import task_dirs
from opencomposer.tasks.jobs import Journal, batch_id, draw_jobs, job_key
from opencomposer.tasks.prepare import prepare_source
from opencomposer.tasks.sources import Check
from opencomposer.tasks.validate import Worker, module_of, select_targets, test_items


@dataclass
class MakeReport:
    source: str
    made: list[str] = field(default_factory=list)
    tried: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    baseline_passed: int = 0
    flaky: int = 0  # tests whose outcome changed across the three baseline runs (dropped)
    install: str = ""  # how the environment was made: recipe | repair | agent | cached
    levels: dict[str, int] = field(default_factory=dict)  # tasks made per level
    candidates: int = 0  # (candidate, level) jobs available: made/tried x this = the library's yield
    seconds: dict[str, float] = field(default_factory=dict)
    resumed: int = 0  # jobs skipped because the journal says an earlier run tried them
    runs: dict[str, int] = field(default_factory=dict)  # test runs per candidate: deletion, confirm

    def reject(self, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1


def make_tasks(source: str, out: Path, max_tasks: int = 50, seed: int = 0, backend: str = "local",
               levels: tuple[str, ...] | dict[str, float] = ("body", "function"), timeout: float = 300.0,
               workers: int = 2, progress: Callable[[str, int, int], None] | None = None,
               policy: Policy | None = None, max_candidates: int | None = None,
               trace: bool = True, check: Check | None = None) -> MakeReport:
    """Tasks from one source. ``levels`` is a tuple (equal weights) or level -> weight, e.g.
    ``difficulty.LevelSchedule.weights()``; ``policy`` enables the install agent; ``check`` grades
    each staged task before it is written (module docstring). Resumes from ``OUT/_journal``
    (module docstring): ``max_tasks`` counts tasks this batch made before."""
    weights = dict(levels) if isinstance(levels, dict) else {lv: 1.0 for lv in levels}
    bad = sorted(set(weights) - set(deletion.LEVELS))
    if bad or not any(w > 0 for w in weights.values()):
        raise ValueError(f"levels {sorted(weights)}: unknown {bad}; expected some of {deletion.LEVELS}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)  # the staging dirs of a killed run: never tasks, and never read
    report = MakeReport(source)
    t0 = time.time()
    prep = prepare_source(source, out, backend, timeout, policy, trace)
    report.baseline_passed = len(prep.baseline.passed() - prep.flaky)
    report.flaky, report.install = len(prep.flaky), prep.install
    report.seconds["prepare"] = round(time.time() - t0, 1)
    journal = Journal(out / "_journal" / f"{prep.env.name}.jsonl", batch_id(seed, weights))
    journal.add({"event": "prepared", "install": prep.install}, t0)
    for ln in journal.tried.values():  # this batch's earlier tries count as tried by this report
        if ln.get("batch") == journal.batch:
            report.tried += 1
            if ln.get("task"):
                report.made.append(ln["task"])
                report.levels[ln["level"]] = report.levels.get(ln["level"], 0) + 1
            else:
                report.reject(ln["outcome"])
    report.made = [t for t in report.made if (out / t / "task.toml").exists()]
    rng = random.Random(seed)
    jobs = draw_jobs(prep, weights, rng)
    report.candidates = len(jobs)
    jobs = jobs[:max_candidates]
    todo = [j for j in jobs if job_key(*j) not in journal.tried]
    report.resumed = len(jobs) - len(todo)
    existing = {p.name for p in task_dirs(out)}
    lock = threading.Lock()
    state = {"next": 0, "writing": 0}  # next job; tasks being written (slots reserved under max_tasks)
    stable = prep.baseline.passed() - prep.flaky  # passed in all three baseline runs
    baseline_files = {t.split("::", 1)[0] for t in stable}
    items = {f: test_items(prep.root, f) for f in prep.layout.test_files if f in baseline_files}
    by_func = prep.test_map.by_function() if prep.test_map else {}

    def covering(members) -> set[str]:
        hit: set[str] = set()
        for m in members:
            for (f, ln), tests in by_func.items():
                if f == m.file and m.decorator_lineno <= ln <= m.end_lineno:
                    hit |= tests
        return hit

    def quota_full() -> bool:  # call under ``lock``: tasks counted plus those being written
        return len(report.made) + state["writing"] >= max_tasks

    def release() -> None:  # a reserved slot whose task was not written
        with lock:
            state["writing"] -= 1

    def take():
        with lock:
            if len(report.made) >= max_tasks or state["next"] >= len(todo):
                return None
            job = todo[state["next"]]
            state["next"] += 1
            report.tried += 1
            return job

    def work():
        w = Worker(prep, backend, timeout)
        try:
            while (job := take()) is not None:
                obj, level = job
                outcome, task, detail = _one(w, obj, level, random.Random(f"{seed}/{job_key(obj, level)}/{level}"))
                with lock:
                    if task:
                        state["writing"] -= 1
                        report.made.append(task)
                        report.levels[level] = report.levels.get(level, 0) + 1
                        if progress:
                            progress(task, len(report.made), max_tasks)
                    elif outcome:
                        report.reject(outcome)
                if outcome:  # None: not tried after all (the quota filled meanwhile)
                    journal.add({"key": job_key(obj, level), "level": level, "outcome": outcome,
                                 "task": task, **({"detail": detail} if detail else {})}, t0)
        finally:
            w.sb.close()

    def count_run(kind: str) -> None:
        with lock:
            report.runs[kind] = report.runs.get(kind, 0) + 1

    def graded(task_dir: Path):  # ``check``, counted as the test runs are
        count_run("grade")
        return check(task_dir)

    def _one(w: Worker, obj, level: str, crng: random.Random) -> tuple[str | None, str | None, str]:
        """(outcome, task id if made, detail): outcome is "made" or the rejection reason."""
        try:
            return (*_judge(w, obj, level, crng), "")
        except GraderRejects as e:  # the reason counted; what the grader saw goes to the journal
            return "the grader rejects it (start or gold)", None, str(e)[:500]

    def _judge(w: Worker, obj, level: str, crng: random.Random) -> tuple[str | None, str | None]:
        try:
            if isinstance(obj, deletion.Feature):
                d = deletion.delete_feature(prep.root, obj)
            else:
                d = deletion.delete(deletion.read_source(prep.root / obj.file), obj, level)
        except deletion.DeletionError:
            return "not line-editable", None
        tid = task_id(prep.env.name, d.candidate, level)
        if tid in existing:  # renamed into place by a run killed before its journal line
            with lock:
                state["writing"] += 1  # work() counts it like a task written now
            return "made", tid
        targets = tuple(select_targets(items, [m.name for m in d.members], crng, covering(d.members)))
        if not targets:
            return "no test mentions or runs it", None
        chosen = set(targets)
        expected = sorted(t for t in stable if item_of(t) in chosen or t in chosen)
        w.apply(d.files)
        if level in ("function", "class"):  # removing a definition may break the import itself
            modules = [m for m in (module_of(f, prep.layout.pythonpath) for f in d.files) if m]
            if modules and w.imports(modules):
                count_run("import probe")
                return "deletion breaks importing the library", None
            count_run("import probe")
        after = w.run(targets)
        count_run("deletion")
        if after.timed_out:
            return "tests time out after deletion", None
        f2p = [t for t in expected if after.status(t) not in ("PASSED", "XFAIL")]
        p2p = [t for t in expected if after.status(t) in ("PASSED", "XFAIL")]
        if not f2p:
            return "no test fails after deletion", None
        if not p2p:
            return "every selected test fails (deletion not targeted)", None
        with lock:
            if quota_full():
                return None, None
        alone = w.original(targets)  # the tests must pass on the original tree run on their own
        count_run("confirm")
        f2p = [t for t in f2p if alone.status(t) in ("PASSED", "XFAIL")]
        p2p = [t for t in p2p if alone.status(t) in ("PASSED", "XFAIL")]
        if not f2p or not p2p:
            return "selected tests fail on the original tree when run alone", None
        with lock:  # reserve a slot: two workers past this point at once must not overshoot max_tasks
            if quota_full():
                return None, None
            state["writing"] += 1
        try:
            path = write_task(prep, out, d, list(targets), f2p, p2p, crng, graded if check else None)
        except LeakFound:
            release()
            return "the leak probe found the deleted code", None
        except BaseException:  # GraderRejects included: _one names it
            release()
            raise
        return "made", path.name  # work() releases the slot as it counts the task

    t1 = time.time()
    try:
        with ThreadPoolExecutor(workers) as ex:
            for f in [ex.submit(work) for _ in range(workers)]:
                f.result()
    finally:
        journal.add({"event": "stopped"}, t0)
        journal.close()
    report.seconds["delete_and_validate"] = round(time.time() - t1, 1)
    report.seconds["total"] = round(time.time() - t0, 1)
    report.seconds["earlier_sessions"] = round(journal.earlier_seconds(), 1)
    return report
