"""SWE-bench JSONL <-> tasks.

    opencomposer tasks import swebench rows.jsonl --repos clones/ --out tasks/
    opencomposer tasks export swebench tasks/ --out rows.jsonl --repos-out clones/

Import, per row (``instance_id, repo, base_commit, patch, test_patch,
problem_statement, FAIL_TO_PASS, PASS_TO_PASS``; the last two as lists or JSON-encoded
lists, as the published datasets store them): the tree of ``base_commit`` from the local
clone of ``repo`` under ``--repos`` (``owner__name``, ``name`` or ``owner/name``) is the
workspace, with nothing applied; the files ``test_patch`` writes (plus every
``conftest.py``) become the hidden tests; ``patch`` is the gold patch; the problem
statement is the instruction; the tests run are FAIL_TO_PASS + PASS_TO_PASS node ids.
The environment is built from the project's declared test requirements (one per
``repo`` + ``environment_setup_commit``), or ``--env`` is used.

Export, per task: its workspace (a single-commit git repo) is cloned to
``REPOS_OUT/opencomposer__<id>`` and becomes ``repo`` + ``base_commit``; hidden test
files that differ from the workspace become ``test_patch``. What SWE-bench has no field
for (test targets, feature, pythonpath, timeout) travels in an ``opencomposer`` key that
the importer honours, so export -> import gives the same task.

A row is untrusted: its ``instance_id`` must make one task directory name, the env its
``opencomposer.env`` names is used only when it lies in ``OUT/_envs`` (``format.env_outside``),
and the task written passes ``format.check_paths`` (files, targets, pythonpath inside the
workspace); otherwise the row fails with the field and the path.

Test: ``pytest tests/integration/test_task_formats.py tests/unit/tasks/sources/test_confine.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from opencomposer.harness.patch import PatchError, apply_hunks, parse_patch
from opencomposer.tasks.envs import EnvError
from opencomposer.tasks.format import (
    ENVS,
    EnvironmentInfo,
    FeatureInfo,
    SourceInfo,
    Task,
    TaskFormatError,
    TaskMeta,
    TestsInfo,
    check_task_id,
    env_outside,
)
from opencomposer.tasks.layout import inspect_project
from opencomposer.tasks.pypi import SourceError
from opencomposer.tasks.sources import Check, ImportReport, ItemError
from opencomposer.tasks.sources.assemble import file_diff, source_env, write_task_dir
from opencomposer.tasks.sources.repo import export_commit
from opencomposer.tasks.testrun import DEFAULT_COMMAND

TEXT_FIELDS = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement")
LIST_FIELDS = ("FAIL_TO_PASS", "PASS_TO_PASS")
EXTRA = "opencomposer"


def _tests_list(row: dict, key: str, where: str) -> list[str]:
    v = row[key]
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            raise ItemError(f"{where}: field {key!r}: expected a list of test ids or a JSON-encoded list, "
                            f"got the string {v[:60]!r}") from None
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ItemError(f"{where}: field {key!r}: expected a list of test ids, got {type(v).__name__}")
    return v


def validate_row(row: object, where: str) -> tuple[list[str], list[str]]:
    """Raise ItemError naming the field unless ``row`` is a usable SWE-bench instance."""
    if not isinstance(row, dict):
        raise ItemError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in TEXT_FIELDS + LIST_FIELDS if k not in row]
    if missing:
        raise ItemError(f"{where}: missing field(s) {missing}")
    for k in TEXT_FIELDS:
        if not isinstance(row[k], str) or not row[k].strip():
            raise ItemError(f"{where}: field {k!r}: expected a non-empty string, got {row[k]!r:.60}")
    f2p, p2p = _tests_list(row, "FAIL_TO_PASS", where), _tests_list(row, "PASS_TO_PASS", where)
    if not f2p:
        raise ItemError(f"{where}: field 'FAIL_TO_PASS': empty; a task needs at least one failing test")
    return f2p, p2p


def find_clone(repos: Path, repo: str) -> Path:
    owner, _, name = repo.rpartition("/")
    tries = [repos / f"{owner}__{name}", repos / name, repos / repo] if owner else [repos / name]
    for p in tries:
        if (p / ".git").exists() or (p / "HEAD").is_file():
            return p
    raise ItemError(f"field 'repo': no local git clone of {repo!r} under {repos} "
                    f"(looked for {', '.join(p.name if p.parent == repos else str(p) for p in tries)})")


def _text(root: Path, rel: str) -> str | None:
    p = root / rel
    return p.read_text() if p.is_file() else None


def hidden_from_test_patch(tree: Path, test_patch: str, where: str) -> dict[str, bytes]:
    """Files as the test patch leaves them, plus every conftest.py: the hidden tests."""
    try:
        patches = parse_patch(test_patch)
    except PatchError as e:
        raise ItemError(f"{where}: field 'test_patch': {e}") from None
    hidden: dict[str, bytes] = {}
    for fp in patches:
        if fp.is_delete:
            raise ItemError(f"{where}: field 'test_patch': deletes {fp.path}; hidden tests can only add or change files")
        old = "" if fp.is_new else _text(tree, fp.path)
        if old is None:
            raise ItemError(f"{where}: field 'test_patch': changes {fp.path}, which is not in the repo at base_commit")
        try:
            hidden[fp.path] = apply_hunks(old, fp.hunks, fp.path).encode()
        except PatchError as e:
            raise ItemError(f"{where}: field 'test_patch': does not apply at base_commit: {e}") from None
    for c in sorted(tree.rglob("conftest.py")):
        hidden.setdefault(c.relative_to(tree).as_posix(), c.read_bytes())
    return hidden


def _known_env(extra: dict, out: Path, tid: str, where: str) -> Path | None:
    """The env a row we exported was made with, when it is on this machine (else one is built);
    refused unless it lies in ``OUT/_envs`` (a row may name any path)."""
    e = extra.get("env")
    if not (e and Path(e, "bin", "python").exists()):
        return None
    why = env_outside(out / tid, os.path.relpath(Path(e).absolute(), (out / tid).absolute()))
    if why:
        raise ItemError(f"{where}: field '{EXTRA}.env': path {e!r} {why}; an imported task's env must "
                        f"already be in {out / ENVS} (or pass --env)")
    return Path(e)


def row_task(row: dict, where: str, repos: Path, out: Path, env: Path | None) -> Path:
    f2p, p2p = validate_row(row, where)
    extra = row.get(EXTRA) or {}
    try:
        parse_patch(row["patch"])
    except PatchError as e:
        raise ItemError(f"{where}: field 'patch': {e}") from None
    try:
        clone = find_clone(repos, row["repo"])
    except ItemError as e:
        raise ItemError(f"{where}: {e}") from None
    tid = re.sub(r"[^A-Za-z0-9_.-]+", "_", row["instance_id"])
    try:
        check_task_id(tid, f"{where}: field 'instance_id'")
    except TaskFormatError as e:
        raise ItemError(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="swebench-") as tmp:
        tree = Path(tmp) / "tree"
        try:
            export_commit(clone, row["base_commit"], tree)
        except SourceError as e:
            raise ItemError(f"{where}: field 'base_commit': {e}") from None
        hidden = hidden_from_test_patch(tree, row["test_patch"], where)
        layout = inspect_project(tree)
        setup = row.get("environment_setup_commit") or row["base_commit"]
        env_dir = source_env(tree, f"{row['repo'].replace('/', '__')}-{setup[:12]}", out, env or _known_env(extra, out, tid, where))
        gold_files = [fp.path for fp in parse_patch(row["patch"])]
        feat = extra.get("feature") or {"level": "issue", "file": gold_files[0],
                                          "symbol": Path(gold_files[0]).stem, "lines_removed": 0}
        targets = extra.get("targets") or list(dict.fromkeys(f2p + p2p))
        files = extra.get("files") or sorted({t.split("::", 1)[0] for t in targets} | set(hidden))
        meta = TaskMeta(
            id=tid,
            # a row we exported keeps the task's own source; any other row came from SWE-bench
            source=SourceInfo(**extra["source"]) if extra.get("source") else SourceInfo(
                kind="swebench", spec=row["instance_id"], package=extra.get("package", "")),
            feature=FeatureInfo(**feat),
            environment=EnvironmentInfo(pythonpath=extra.get("pythonpath", layout.pythonpath)),
            tests=TestsInfo(command=extra.get("command", DEFAULT_COMMAND), files=files, targets=targets,
                            fail_to_pass=f2p, pass_to_pass=p2p, timeout=extra.get("timeout", 300.0)),
        )
        return write_task_dir(out, meta, row["problem_statement"], tree, hidden, row["patch"], env=env_dir)


def import_swebench(jsonl: Path, repos: Path, out: Path, env: Path | None = None,
                    check: Check | None = None) -> ImportReport:
    """One task per usable row; bad rows are reported (file, row, field) and skipped over.
    ``check``: validates each task written (``tasks check``: the caller passes
    ``grading.check.check_task`` bound to a backend); a task that fails it is removed and
    counted as failed."""

    t0 = time.time()
    jsonl, repos, out = Path(jsonl), Path(repos), Path(out)
    report = ImportReport(f"swebench:{jsonl}")
    if not jsonl.is_file():
        raise SourceError(f"{jsonl}: no such file (expected SWE-bench JSONL)")
    if not repos.is_dir():
        raise SourceError(f"--repos {repos}: not a directory (expected local clones, one per repo)")
    for n, line in enumerate(jsonl.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{jsonl}: row {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            report.failed[f"row {n}"] = f"{where}: not valid JSON: {e}"
            continue
        name = row.get("instance_id") if isinstance(row, dict) and isinstance(row.get("instance_id"), str) else f"row {n}"
        try:
            path = row_task(row, where, repos, out, env)
        except ItemError as e:
            report.failed[name] = str(e)
            continue
        except (ValueError, EnvError) as e:  # e.g. its env cannot be built: this row fails, the rest go on
            report.failed[name] = f"{where}: {type(e).__name__}: {e}"
            continue
        if check:
            res = check(path)
            if not res.ok:
                shutil.rmtree(path, ignore_errors=True)
                report.failed[name] = f"{where}: task fails its check: {'; '.join(res.problems)[:400]}"
                continue
        report.ok.append(path.name)
    report.seconds = time.time() - t0
    return report


# --------------------------------------------------------------------------- export


def _git_out(*args: str) -> str:
    r = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    if r.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout.strip()


def hidden_tests_patch(task: Task) -> str:
    """Hidden test files that differ from the workspace, as a diff against it."""
    parts = []
    for f in sorted(task.hidden_tests.rglob("*")):
        if f.is_file():
            rel = f.relative_to(task.hidden_tests).as_posix()
            old = _text(task.workspace, rel)
            new = f.read_text()
            if old != new:
                parts.append(file_diff(rel, old, new))
    return "".join(parts)


def task_row(task: Task, repos_out: Path | None) -> dict:
    m = task.meta
    repo = f"opencomposer/{task.id}"
    commit = _git_out("-C", str(task.workspace), "rev-parse", "HEAD")
    if repos_out is not None:
        dest = repos_out / repo.replace("/", "__")
        if dest.exists():
            shutil.rmtree(dest)
        _git_out("clone", "--quiet", str(task.workspace), str(dest))
    return {
        "instance_id": task.id, "repo": repo, "base_commit": commit,
        "patch": task.gold_patch, "test_patch": hidden_tests_patch(task),
        "problem_statement": task.instruction, "hints_text": "", "created_at": "", "version": "1.0",
        "environment_setup_commit": commit,
        "FAIL_TO_PASS": json.dumps(m.tests.fail_to_pass), "PASS_TO_PASS": json.dumps(m.tests.pass_to_pass),
        EXTRA: {"targets": m.tests.targets, "files": m.tests.files, "command": m.tests.command, "timeout": m.tests.timeout,
                "pythonpath": m.environment.pythonpath, "package": m.source.package,
                "feature": m.feature.model_dump(), "source": m.source.model_dump(),
                "env": str(task.env_dir) if task.env_dir else ""},
    }
