"""One library made ready for feature deletion: its tree, environment and baseline test outcomes.

    prep = prepare_source("pypi:more-itertools==10.5.0", Path("tasks/"), backend="namespace", timeout=300)
    prep.baseline.passed() - prep.flaky   # the tests every deletion is judged against

Fetch and unpack the source (a PyPI sdist, a local dir or a git commit) -> read its layout ->
install it (``install.install_repo``: discovered recipe, repair, optional agent; verified by
running the suite) -> run the suite twice more, once under the tracer
(``coverage.trace_tests``), so every test ran three times: tests whose outcome changed are
flaky and never become FAIL_TO_PASS or PASS_TO_PASS.

The result is cached beside the environment (``_envs/<slug>/prep.json``, keyed by a hash of
the source tree), so a resumed ``tasks make`` skips the three suite runs.

Test: ``pytest tests/unit/tasks/test_resume.py tests/unit/tasks/test_factory.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from opencomposer.paths import atomic_write_text, cache_dir
from opencomposer.protocols import Policy, SandboxSpec
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks import leakage
from opencomposer.tasks.coverage import TestMap, flaky_tests, trace_tests
from opencomposer.tasks.install import install_repo
from opencomposer.tasks.layout import ProjectLayout, inspect_project
from opencomposer.tasks.pypi import SourceError, fetch_sdist, unpack_sdist
from opencomposer.tasks.testrun import TestReport, run_tests

PREP_FILE = "prep.json"  # cached prepared state, inside the source's environment dir


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

