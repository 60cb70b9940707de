"""Turn a real library into validated feature-deletion tasks.

    opencomposer tasks make --source pypi:more-itertools==10.5.0 --out tasks/ --max 50

Steps (each a function below): fetch and unpack the sdist -> read its layout -> install it
(``install.install_repo``: discovered recipe, repair, optional agent; verified by running
the suite) -> run the suite twice more, once under the tracer (``coverage.trace_tests``),
so every test ran three times: tests whose outcome changed are flaky and never become
FAIL_TO_PASS or PASS_TO_PASS -> draw (candidate, level) jobs, levels weighted as asked ->
for each, delete in a sandbox and rerun the tests that execute or mention it -> keep it
when some tests fail (FAIL_TO_PASS) and the rest still pass (PASS_TO_PASS) -> write the task
directory (``tasks/format.py``) atomically, scrubbed of every leak channel, after the full
leak probe (``leakage.leak_scan``: workspace and git objects, the env with its archives and
compiled files) found nothing; a flagged candidate is rejected and never written.

Validation order (the cheap way that keeps every guarantee): a ``function`` or ``class``
deletion first gets an import probe (``python -c "import the.module"``): one that breaks the
library's import fails every test, so it is rejected without a test run. The tests a
candidate selects are expected to pass as they did in all three baseline runs, so the
deletion is run first;
only a candidate that then looks like a task (some selected tests fail, some still pass)
pays for a second run of the same tests on the original tree, which confirms that every
FAIL_TO_PASS and PASS_TO_PASS test passes there when run on its own.

Resumable: the prepared state (baseline outcomes, flaky tests, test map) is cached beside
the environment (``_envs/<slug>/prep.json``, keyed by a hash of the source tree), and every
candidate tried is appended to ``OUT/_journal/<slug>.jsonl`` with its outcome. A rerun of the
same command (same seed and level weights: the same *batch*) skips what was tried and counts
what was made towards ``max_tasks``; a new batch (``TaskFactory.harder`` moved the levels, or
another seed) skips every job any batch tried but starts its own count.

Killed at any moment, a rerun yields each task once: a task is built in a staging dir
``OUT/.<id>.tmp-<host>-<pid>-<rand>`` (``paths.staged_dir``) and renamed into place whole;
no reader lists a ``.`` dir (``format.task_dirs``), and the next run removes the staging dirs
of dead runs (``paths.remove_stale_temps``). A task renamed into place by a run killed before
its journal line is found on disk by the rerun and counted, not made again.

Test: ``pytest tests/integration/test_tasks_pipeline.py tests/integration/test_tasks_make_killed.py tests/unit/tasks_factory``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from opencomposer.paths import (
    atomic_write_text,
    cache_dir,
    remove_stale_temps,
    staged_dir,
)
from opencomposer.protocols import Policy, SandboxSpec
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks import deletion, instructions, leakage, pyparse
from opencomposer.tasks.leakage import leak_scan
from opencomposer.tasks.coverage import TestMap, flaky_tests, item_of, trace_tests
from opencomposer.tasks.format import (
    EnvironmentInfo,
    FeatureInfo,
    SourceInfo,
    Task,
    TaskMeta,
    TestsInfo,
    task_dirs,
    write_task_toml,
)
from opencomposer.tasks.install import install_repo
from opencomposer.tasks.layout import ProjectLayout, inspect_project
from opencomposer.tasks.pypi import SourceError, fetch_sdist, unpack_sdist
from opencomposer.tasks.testrun import DEFAULT_COMMAND, TestReport, run_tests

MAX_COVERING = 30  # test items kept per deletion among those that execute it
PREP_FILE = "prep.json"  # cached prepared state, inside the source's environment dir
IMPORT_PROBE = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)"


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


@dataclass
class Prepared:
    """A source ready for deletion: pristine tree, layout, env, baseline, flaky tests, test map."""

    name: str
    version: str
    spec: str
    root: Path
    layout: ProjectLayout
    env: Path
    baseline: TestReport
    flaky: set[str] = field(default_factory=set)
    test_map: TestMap | None = None
    install: str = ""
    kind: str = "pypi"  # pypi | dir -> "local" | git
    traced: bool = True  # whether the suite ran under the tracer (test_map may still be None)


def prepare_source(source: str, out: Path, backend: str, timeout: float, policy: Policy | None = None,
                   trace: bool = True) -> Prepared:
    kind, _, spec = source.partition(":")
    if kind in ("dir", "git"):  # a local tree, or a git repository at a commit
        from opencomposer.tasks.sources.repo import materialize
        name, version, root = materialize(source)
    elif kind == "pypi" and spec:
        ref = fetch_sdist(spec)
        name, version = ref.name, ref.version
        root = unpack_sdist(ref.path, cache_dir("sources") / f"{name}-{version}".lower().replace("_", "-"))
    else:
        raise SourceError(f"--source {source!r}: expected pypi:NAME==VERSION, pypi:PATH/TO/SDIST.tar.gz, "
                          "dir:PATH or git:PATH_OR_URL@COMMIT")
    slug = f"{name}-{version}".lower().replace("_", "-")
    leakage.scrub_workspace(root)
    layout = inspect_project(root)
    cached = load_prepared(out / "_envs" / slug, root, layout, name, version, spec, kind, trace)
    if cached is not None:
        return cached
    if not layout.packages:
        raise SourceError(f"{source}: no importable package found in the source tree ({root})")
    if not layout.test_files:
        raise SourceError(
            f"{source}: the source ships no test files (test_*.py or *_test.py); "
            "feature deletion needs the library's tests as the reward"
        )
    inst = install_repo(layout, name, out / "_envs" / slug, backend, timeout, policy)
    layout = replace(layout, test_files=inst.test_files or layout.test_files)
    runs = [inst.report]
    test_map = None
    with make_sandbox(SandboxSpec(root, inst.env, layout.pythonpath), backend) as sb:
        if trace:
            test_map = trace_tests(sb, layout.test_files, layout.package_dirs, timeout=timeout * 2)
            if test_map.funcs and not test_map.report.timed_out:  # a cut-short run proves nothing
                runs.append(test_map.report)
            sb.reset()
        runs.append(run_tests(sb, layout.test_files, timeout=timeout))
    prep = Prepared(name, version, spec, root, layout, inst.env, runs[0], flaky_tests(runs),
                    test_map if test_map and test_map.funcs else None, inst.method, kind, trace)
    save_prepared(prep)
    return prep


def tree_hash(root: Path) -> str:
    """sha256 over the tree's files (paths and bytes): what a cached preparation was made from."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in sorted(filenames):
            p = Path(dirpath, f)
            if p.is_file() and not p.is_symlink():
                h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def save_prepared(prep: Prepared) -> None:
    """Cache the baseline, flaky tests and test map beside the env, so a resumed run skips
    the three suite runs (the env itself is reused through its ``env.json``)."""
    tm = prep.test_map
    data = {"tree": tree_hash(prep.root), "traced": prep.traced, "install": prep.install, "test_files": prep.layout.test_files,
            "baseline": prep.baseline.outcomes, "flaky": sorted(prep.flaky),
            "test_map": {"funcs": tm.funcs, "lines": {f: sorted(v) for f, v in tm.lines.items()}} if tm else None}
    atomic_write_text(prep.env / PREP_FILE, json.dumps(data))


def load_prepared(env: Path, root: Path, layout: ProjectLayout, name: str, version: str, spec: str,
                  kind: str, trace: bool = True) -> Prepared | None:
    """The cached preparation of this exact tree, or None (no cache, other tree, unreadable)."""
    path = env / PREP_FILE
    if not (env / "env.json").exists() or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data["tree"] != tree_hash(root) or data.get("traced", True) != trace:
            return None
        tm = data["test_map"]
        test_map = TestMap({t: [tuple(x) for x in fs] for t, fs in tm["funcs"].items()},
                           {f: set(v) for f, v in tm["lines"].items()}) if tm else None
        return Prepared(name, version, spec, root, replace(layout, test_files=data["test_files"]), env,
                        TestReport(dict(data["baseline"])), set(data["flaky"]), test_map,
                        "cached", kind, trace)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def test_items(root: Path, rel: str) -> list[tuple[str, str]]:
    """(node id, source) of the top-level test functions and test classes of one file."""
    text = (root / rel).read_text(errors="replace")
    try:
        tree = pyparse.parse(text)
    except SyntaxError:
        return []
    items = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test") or isinstance(node, ast.ClassDef) and any(
            isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) and b.name.startswith("test") for b in node.body
        ):
            items.append((f"{rel}::{node.name}", ast.get_source_segment(text, node) or ""))
    return items


def select_targets(items: dict[str, list[tuple[str, str]]], names: list[str], rng: random.Random,
                   covering: set[str] | None = None, neighbours: int = 3,
                   max_covering: int = MAX_COVERING) -> list[str]:
    """Test items that mention one of ``names`` or (per the coverage map) execute the deleted
    code, plus a few others from the same files as a regression guard (PASS_TO_PASS)."""
    pat = re.compile(r"\b(?:" + "|".join(re.escape(n) for n in names) + r")\b")
    known = {i for its in items.values() for i, _ in its}
    mention = {i for its in items.values() for i, src in its if pat.search(src)}
    extra = sorted((covering or set()) & known - mention)
    rng.shuffle(extra)
    hit = mention | set(extra[: max(0, max_covering - len(mention))])
    targets: list[str] = []
    for its in items.values():
        mine = [i for i, _ in its if i in hit]
        if not mine:
            continue
        others = [i for i, _ in its if i not in hit]
        targets += mine + rng.sample(others, min(neighbours, len(others)))
    return targets


def _task_id(slug: str, cand, level: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{slug}__{cand.file.removesuffix('.py')}__{cand.qualname}__{level}")


class _Worker:
    """One sandbox per thread, reset between candidates."""

    def __init__(self, prep: Prepared, backend: str, timeout: float):
        self.prep, self.timeout = prep, timeout
        self.sb = make_sandbox(SandboxSpec(prep.root, prep.env, prep.layout.pythonpath), backend)

    def original(self, targets: tuple[str, ...]) -> TestReport:
        """The selected tests, run alone on the original tree."""
        self.sb.reset()
        return run_tests(self.sb, list(targets), timeout=self.timeout)

    def apply(self, files: dict[str, tuple[str, str]]) -> None:
        self.sb.reset()
        for rel, (_, after) in files.items():
            self.sb.write_file(rel, after.encode())

    def imports(self, modules: list[str]) -> str:
        """'' if ``modules`` import in the (deleted) tree, else the error's last line."""
        r = self.sb.exec(["python", "-c", IMPORT_PROBE, *modules], timeout=min(self.timeout, 120))
        return "" if r.exit_code == 0 else (r.output.strip().splitlines() or ["?"])[-1][:200]

    def run(self, targets: tuple[str, ...]) -> TestReport:
        return run_tests(self.sb, list(targets), timeout=self.timeout)


def write_task(prep: Prepared, out: Path, d, targets: list[str],
               f2p: list[str], p2p: list[str], rng: random.Random) -> Path:
    """Write the task of deletion ``d`` (a ``Deletion`` or ``FeatureDeletion``) atomically."""
    cand, level, removed = d.candidate, d.level, d.removed
    slug = prep.env.name
    tid = _task_id(slug, cand, level)
    final = out / tid
    with staged_dir(final) as tmp:
        ws = tmp / "workspace"
        shutil.copytree(prep.root, ws, symlinks=True)
        for rel, (_, after) in d.files.items():
            (ws / rel).write_bytes(after.encode())
        files = sorted({t.split("::", 1)[0] for t in targets})
        hidden = sorted(set(files) | {p.relative_to(ws).as_posix() for p in ws.rglob("conftest.py")})
        f2p_files = {t.split("::", 1)[0] for t in f2p}
        for rel in hidden:
            dst = tmp / "tests" / "files" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(prep.root / rel, dst)
            if rel in f2p_files:  # tests that reveal the feature are never visible before grading
                (ws / rel).unlink()
        leakage.scrub_workspace(ws)
        leakage.fresh_git(ws)
        (tmp / "solution").mkdir()
        (tmp / "solution" / "gold.patch").write_text(d.patch)
        (tmp / "solution" / "solve.sh").write_text("#!/bin/sh\n# run from the workspace root\nexec patch -p1 < \"$(dirname \"$0\")/gold.patch\"\n")
        (tmp / "tests" / "test.sh").write_text(
            "#!/bin/sh\n# copy tests/files over the workspace first; run from the workspace root\n"
            f"exec {DEFAULT_COMMAND} {' '.join(shlex.quote(t) for t in targets)}\n")
        original_def = deletion.definition_text(d.before, cand)
        instr = instructions.make_instruction(cand, level, original_def, rng, members=d.members)
        (tmp / "instruction.md").write_text(instr + "\n")
        meta = TaskMeta(
            id=tid,
            source=SourceInfo(kind={"dir": "local"}.get(prep.kind, prep.kind),
                              spec={"pypi": f"{prep.name}=={prep.version}",  # git: the commit, not the branch
                                    "git": f"{prep.spec.rpartition('@')[0]}@{prep.version}"}.get(prep.kind, prep.spec),
                              package=cand.file.removeprefix("src/").split("/")[0].removesuffix(".py")),
            feature=FeatureInfo(level=level, file=cand.file, symbol=cand.qualname,
                                lines_removed=removed.count("\n") + 1),
            environment=EnvironmentInfo(env=f"../_envs/{slug}", pythonpath=prep.layout.pythonpath),
            tests=TestsInfo(command=DEFAULT_COMMAND, files=files, targets=targets, fail_to_pass=f2p,
                            pass_to_pass=p2p),
        )
        write_task_toml(tmp / "task.toml", meta)
        # the full leak probe (workspace with its git objects, the env with its archives and
        # compiled files) before the task exists: a flagged task is never written
        _, suspects = leak_scan(Task.load(tmp))
        if suspects:
            where, found = next(iter(suspects.items()))
            raise LeakFound(f"{where.replace(str(tmp), tid)} holds {len(found)} deleted lines, "
                            f"e.g. {min(found)!r}")
    return final


class LeakFound(Exception):
    """The leak probe found the deleted code somewhere a task's sandbox can read."""


def module_of(rel: str, pythonpath: list[str]) -> str | None:
    """``src/pkg/mod.py`` with pythonpath ``["src"]`` -> ``pkg.mod`` (None if outside it)."""
    for base in sorted(pythonpath, key=len, reverse=True):
        base = base.strip("/")
        if base in ("", "."):
            sub = rel
        elif rel.startswith(base + "/"):
            sub = rel[len(base) + 1:]
        else:
            continue
        parts = sub.removesuffix(".py").split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and all(x.isidentifier() for x in parts):
            return ".".join(parts)
    return None


def job_key(obj, level: str) -> str:
    """What a job uses up: a function's ``block`` (one inner statement) or its whole body
    (``body``, ``function`` and a ``feature`` anchored on it all remove that), or a class."""
    cand = obj.anchor if isinstance(obj, deletion.Feature) else obj
    return f"{cand.id}#{'block' if level == 'block' else 'whole'}"


def draw_jobs(prep: Prepared, weights: dict[str, float], rng: random.Random) -> list[tuple[object, str]]:
    """(candidate or feature, level) pairs in the order to try them: each draw picks a level with
    probability proportional to its weight among levels that still have unused candidates,
    then an unused candidate of that level. A function gives at most two jobs: one block
    deletion and one whole-body one (body, function or a feature anchored on it)."""
    classes = weights.get("class", 0) > 0
    cands = deletion.find_candidates(prep.root, prep.layout.package_dirs,
                                     prep.test_map.lines if prep.test_map else None, classes=classes)
    funcs = [c for c in cands if c.kind == "function"]
    pools: dict[str, list] = {
        "block": [c for c in funcs if "block" in c.levels],
        "body": list(funcs),
        "function": [c for c in funcs if "function" in c.levels],
        "class": [c for c in cands if c.kind == "class"],
        "feature": deletion.find_features(funcs) if weights.get("feature", 0) > 0 else [],
    }
    for p in pools.values():
        rng.shuffle(p)
    used: set[str] = set()
    jobs = []
    while True:
        live = [lv for lv, w in weights.items() if w > 0 and pools.get(lv)]
        if not live:
            return jobs
        lv = rng.choices(live, [weights[x] for x in live])[0]
        obj = pools[lv].pop()
        key = job_key(obj, lv)
        if key not in used:
            used.add(key)
            jobs.append((obj, lv))


class Journal:
    """``OUT/_journal/<slug>.jsonl``: one line per job tried (key, level, batch, outcome, task
    id if made) plus one per session start; appended under a lock, read back on resume."""

    def __init__(self, path: Path, batch: str):
        self.path, self.batch = path, batch
        self.session = f"{time.time():.3f}"
        self.tried: dict[str, dict] = {}  # job key -> its latest line
        self.seconds: dict[str, float] = {}  # session -> seconds it ran (latest line's "s")
        if path.exists():
            for raw in path.read_text().splitlines():
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue  # a line cut short by a kill: that job is simply tried again
                if "key" in line:
                    self.tried[line["key"]] = line
                if "session" in line:
                    self.seconds[line["session"]] = max(self.seconds.get(line["session"], 0.0), line.get("s", 0.0))
        path.parent.mkdir(parents=True, exist_ok=True)
        torn = path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
        self._f = open(path, "a")
        self._lock = threading.Lock()
        if torn:  # a kill cut the last line short: start ours on a fresh line
            self._f.write("\n")

    def add(self, line: dict, t0: float) -> None:
        line = {**line, "batch": self.batch, "session": self.session, "s": round(time.time() - t0, 1)}
        with self._lock:
            self._f.write(json.dumps(line) + "\n")
            self._f.flush()
            if "key" in line:
                self.tried[line["key"]] = line

    def earlier_seconds(self) -> float:
        return sum(s for k, s in self.seconds.items() if k != self.session)

    def close(self) -> None:
        self._f.close()


def batch_id(seed: int, weights: dict[str, float]) -> str:
    return f"seed{seed}:" + ",".join(f"{lv}={w:g}" for lv, w in sorted(weights.items()) if w > 0)


def make_tasks(source: str, out: Path, max_tasks: int = 50, seed: int = 0, backend: str = "local",
               levels: tuple[str, ...] | dict[str, float] = ("body", "function"), timeout: float = 300.0,
               workers: int = 2, progress: Callable[[str, int, int], None] | None = None,
               policy: Policy | None = None, max_candidates: int | None = None,
               trace: bool = True) -> MakeReport:
    """Tasks from one source. ``levels`` is a tuple (equal weights) or level -> weight, e.g.
    ``difficulty.LevelSchedule.weights()``; ``policy`` enables the install agent. Resumes from
    ``OUT/_journal`` (module docstring): ``max_tasks`` counts tasks this batch made before."""
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
        w = _Worker(prep, backend, timeout)
        try:
            while (job := take()) is not None:
                obj, level = job
                outcome, task = _one(w, obj, level, random.Random(f"{seed}/{job_key(obj, level)}/{level}"))
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
                                 "task": task}, t0)
        finally:
            w.sb.close()

    def count_run(kind: str) -> None:
        with lock:
            report.runs[kind] = report.runs.get(kind, 0) + 1

    def _one(w: _Worker, obj, level: str, crng: random.Random) -> tuple[str | None, str | None]:
        """(outcome, task id if made): outcome is "made" or the rejection reason."""
        try:
            if isinstance(obj, deletion.Feature):
                d = deletion.delete_feature(prep.root, obj)
            else:
                d = deletion.delete(deletion.read_source(prep.root / obj.file), obj, level)
        except deletion.DeletionError:
            return "not line-editable", None
        tid = _task_id(prep.env.name, d.candidate, level)
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
            path = write_task(prep, out, d, list(targets), f2p, p2p, crng)
        except LeakFound:
            release()
            return "the leak probe found the deleted code", None
        except BaseException:
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
