"""Turn a real library into validated feature-deletion tasks.

    opencomposer tasks make --source pypi:more-itertools==10.5.0 --out tasks/ --max 50

Steps (each a function below): fetch and unpack the sdist -> read its layout -> build
its environment -> run its tests once to learn which pass -> for each candidate
function, delete it in a sandbox and rerun the test files that mention it -> keep it
when some tests fail (FAIL_TO_PASS) and the rest still pass (PASS_TO_PASS) -> write
the task directory (``tasks/format.py``) atomically, scrubbed of every leak channel.

Test: ``pytest tests/integration/test_tasks_make.py``.
"""

from __future__ import annotations

import ast
import random
import re
import shlex
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks import deletion, instructions, leakage
from opencomposer.tasks.envs import build_env
from opencomposer.tasks.format import (
    EnvironmentInfo, FeatureInfo, SourceInfo, TaskMeta, TestsInfo, write_task_toml,
)
from opencomposer.tasks.layout import ProjectLayout, inspect_project
from opencomposer.tasks.pypi import SourceError, fetch_sdist, unpack_sdist
from opencomposer.tasks.testrun import DEFAULT_COMMAND, TestReport, run_tests
from opencomposer.paths import cache_dir


@dataclass
class MakeReport:
    source: str
    made: list[str] = field(default_factory=list)
    tried: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    baseline_passed: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def reject(self, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1


@dataclass
class Prepared:
    """A source ready for deletion: pristine tree, layout, env and baseline results."""

    name: str
    version: str
    spec: str
    root: Path
    layout: ProjectLayout
    env: Path
    baseline: TestReport


def prepare_source(source: str, out: Path, backend: str, timeout: float) -> Prepared:
    kind, _, spec = source.partition(":")
    if kind != "pypi" or not spec:
        raise SourceError(
            f"--source {source!r}: expected pypi:NAME==VERSION or pypi:PATH/TO/SDIST.tar.gz "
            "(other sources arrive with the task-factory issue)")
    ref = fetch_sdist(spec)
    slug = f"{ref.name}-{ref.version}".lower().replace("_", "-")
    root = unpack_sdist(ref.path, cache_dir("sources") / slug)
    leakage.scrub_workspace(root)
    layout = inspect_project(root)
    if not layout.packages:
        raise SourceError(f"pypi:{spec}: no importable package found in the sdist ({root})")
    if not layout.test_files:
        raise SourceError(
            f"pypi:{spec}: the sdist ships no test files (test_*.py or *_test.py); "
            "feature deletion needs the library's tests as the reward"
        )
    env = build_env(layout, ref.name, out / "_envs" / slug)
    with make_sandbox(SandboxSpec(root, env, layout.pythonpath), backend) as sb:
        base = run_tests(sb, layout.test_files, timeout=timeout)
    if not base.passed():
        raise SourceError(
            f"pypi:{spec}: its tests cannot run here: 0 of {len(base.outcomes)} passed "
            f"(exit {base.exit_code}{', timed out' if base.timed_out else ''}). Last output:\n"
            + base.output_tail[-1500:]
        )
    return Prepared(ref.name, ref.version, spec, root, layout, env, base)


def test_items(root: Path, rel: str) -> list[tuple[str, str]]:
    """(node id, source) of the top-level test functions and test classes of one file."""
    text = (root / rel).read_text(errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    items = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            items.append((f"{rel}::{node.name}", ast.get_source_segment(text, node) or ""))
        elif isinstance(node, ast.ClassDef) and any(
            isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) and b.name.startswith("test") for b in node.body
        ):
            items.append((f"{rel}::{node.name}", ast.get_source_segment(text, node) or ""))
    return items


def select_targets(items: dict[str, list[tuple[str, str]]], name: str, rng: random.Random,
                   neighbours: int = 3) -> list[str]:
    """Test items that mention ``name``, plus a few others from the same files as a
    regression guard (they become PASS_TO_PASS)."""
    pat = re.compile(rf"\b{re.escape(name)}\b")
    targets: list[str] = []
    for rel, its in items.items():
        hit = [i for i, src in its if pat.search(src)]
        if not hit:
            continue
        others = [i for i, _ in its if i not in hit]
        targets += hit + rng.sample(others, min(neighbours, len(others)))
    return targets


def _task_id(slug: str, cand, level: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{slug}__{cand.file.removesuffix('.py')}__{cand.qualname}__{level}")


class _Worker:
    """One sandbox per thread, reset between candidates; baselines cached per file set."""

    def __init__(self, prep: Prepared, backend: str, timeout: float):
        self.prep, self.timeout = prep, timeout
        self.sb = make_sandbox(SandboxSpec(prep.root, prep.env, prep.layout.pythonpath), backend)

    def baseline(self, targets: tuple[str, ...], cache: dict, lock: threading.Lock) -> TestReport:
        with lock:
            if targets in cache:
                return cache[targets]
        self.sb.reset()
        rep = run_tests(self.sb, list(targets), timeout=self.timeout)
        with lock:
            cache[targets] = rep
        return rep

    def try_deletion(self, rel: str, deleted_src: str, targets: tuple[str, ...]) -> TestReport:
        self.sb.reset()
        self.sb.write_file(rel, deleted_src.encode())
        return run_tests(self.sb, list(targets), timeout=self.timeout)


def write_task(prep: Prepared, out: Path, d: "deletion.Deletion", targets: list[str],
               f2p: list[str], p2p: list[str], rng: random.Random) -> Path:
    cand, level, removed = d.candidate, d.level, d.removed
    slug = prep.env.name
    tid = _task_id(slug, cand, level)
    final = out / tid
    tmp = Path(tempfile.mkdtemp(prefix=f".{tid[:40]}-", dir=out))
    try:
        ws = tmp / "workspace"
        shutil.copytree(prep.root, ws, symlinks=True)
        (ws / cand.file).write_bytes(d.after.encode())
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
        instr = instructions.make_instruction(cand, level, original_def, rng)
        (tmp / "instruction.md").write_text(instr + "\n")
        meta = TaskMeta(
            id=tid,
            source=SourceInfo(kind="pypi", spec=f"{prep.name}=={prep.version}",
                              package=cand.file.removeprefix("src/").split("/")[0].removesuffix(".py")),
            feature=FeatureInfo(level=level, file=cand.file, symbol=cand.qualname,
                                lines_removed=removed.count("\n") + 1),
            environment=EnvironmentInfo(env=f"../_envs/{slug}", pythonpath=prep.layout.pythonpath),
            tests=TestsInfo(command=DEFAULT_COMMAND, files=files, targets=targets, fail_to_pass=f2p,
                            pass_to_pass=p2p),
        )
        write_task_toml(tmp / "task.toml", meta)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        return final
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def make_tasks(source: str, out: Path, max_tasks: int = 50, seed: int = 0, backend: str = "local",
               levels: tuple[str, ...] = ("body", "function"), timeout: float = 300.0,
               workers: int = 2, progress: Callable[[str, int, int], None] | None = None) -> MakeReport:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = MakeReport(source)
    t0 = time.time()
    prep = prepare_source(source, out, backend, timeout)
    report.baseline_passed = len(prep.baseline.passed())
    report.seconds["prepare"] = round(time.time() - t0, 1)
    rng = random.Random(seed)
    cands = deletion.find_candidates(prep.root, prep.layout.package_dirs)
    rng.shuffle(cands)
    existing = {p.name for p in out.iterdir() if (p / "task.toml").exists()}
    cache: dict = {}
    lock = threading.Lock()
    state = {"next": 0}
    baseline_files = {t.split("::", 1)[0] for t in prep.baseline.passed()}
    items = {f: test_items(prep.root, f) for f in prep.layout.test_files if f in baseline_files}

    def take():
        with lock:
            if len(report.made) >= max_tasks or state["next"] >= len(cands):
                return None
            c = cands[state["next"]]
            state["next"] += 1
            report.tried += 1
            return c, rng.choice(levels), random.Random(rng.random())

    def work():
        w = _Worker(prep, backend, timeout)
        try:
            while (item := take()) is not None:
                cand, level, crng = item
                _one(w, cand, level, crng)
        finally:
            w.sb.close()

    def _one(w: _Worker, cand, level: str, crng: random.Random) -> None:
        targets = tuple(select_targets(items, cand.name, crng))
        if not targets:
            return report.reject("no test mentions it")
        if level not in cand.levels:
            level = "body"
        try:
            d = deletion.delete(deletion.read_source(prep.root / cand.file), cand, level)
        except deletion.DeletionError:
            return report.reject("not line-editable")
        if _task_id(prep.env.name, cand, level) in existing:
            return report.reject("already made")
        base = w.baseline(targets, cache, lock)
        passing = sorted(base.passed())
        after = w.try_deletion(cand.file, d.after, targets)
        if after.timed_out:
            return report.reject("tests time out after deletion")
        f2p = [t for t in passing if after.status(t) not in ("PASSED", "XFAIL")]
        p2p = [t for t in passing if after.status(t) in ("PASSED", "XFAIL")]
        if not f2p:
            return report.reject("no test fails after deletion")
        if not p2p:
            return report.reject("every selected test fails (deletion not targeted)")
        with lock:
            if len(report.made) >= max_tasks:
                return
        path = write_task(prep, out, d, list(targets), f2p, p2p, crng)
        with lock:
            report.made.append(path.name)
            if progress:
                progress(path.name, len(report.made), max_tasks)

    t1 = time.time()
    with ThreadPoolExecutor(workers) as ex:
        for f in [ex.submit(work) for _ in range(workers)]:
            f.result()
    report.seconds["delete_and_validate"] = round(time.time() - t1, 1)
    report.seconds["total"] = round(time.time() - t0, 1)
    return report
