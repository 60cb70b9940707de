"""One validated deletion written as a task directory, atomically and only if nothing leaks.

    path = write_task(prep, Path("tasks/"), d, targets, f2p, p2p, random.Random(0))   # tasks/<task_id>

The task is built in a staging dir ``OUT/.<id>.tmp-<host>-<pid>-<rand>`` (``paths.staged_dir``)
and renamed into place whole, so a run killed at any moment leaves either the whole task or
none. Before the rename the workspace is scrubbed of every leak channel and the full leak
probe (``leakage.leak_scan``: workspace and git objects, the env with its archives and
compiled files) runs; a flagged deletion raises ``LeakFound`` and is never written. Then
``check`` (the caller passes ``grading.check.check_task``) grades the staged task as an
agent's work is graded: at start no reward, with the gold patch the reward; a task the grader
judges otherwise raises ``GraderRejects`` and is never written (the factory's own test runs
choose FAIL_TO_PASS and PASS_TO_PASS; the grader has the last word). The format itself is
``tasks/format.py``'s.

Test: ``pytest tests/unit/tasks/test_factory.py tests/integration/test_tasks_make_killed.py``.
"""

from __future__ import annotations

import random
import re
import shlex
import shutil
from pathlib import Path

from opencomposer.paths import staged_dir
from opencomposer.tasks import deletion, instructions, leakage
from opencomposer.tasks.sources.assemble import SOLVE_SH
from opencomposer.tasks.format import (
    EnvironmentInfo,
    FeatureInfo,
    SourceInfo,
    Task,
    TaskMeta,
    TestsInfo,
    write_task_toml,
)
from opencomposer.tasks.leakage import leak_scan
from opencomposer.tasks.prepare import Prepared
from opencomposer.tasks.sources import Check
from opencomposer.tasks.testrun import DEFAULT_COMMAND


def task_id(slug: str, cand, level: str) -> str:
    """``<slug>__<file>__<qualname>__<level>``, made safe as a directory name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{slug}__{cand.file.removesuffix('.py')}__{cand.qualname}__{level}")



def write_task(prep: Prepared, out: Path, d, targets: list[str],
               f2p: list[str], p2p: list[str], rng: random.Random, check: Check | None = None) -> Path:
    """Write the task of deletion ``d`` (a ``Deletion`` or ``FeatureDeletion``) atomically;
    ``check(staging_dir)`` (an object with ``ok`` and ``problems``) must pass first."""
    cand, level, removed = d.candidate, d.level, d.removed
    slug = prep.env.name
    tid = task_id(slug, cand, level)
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
        (tmp / "solution" / "solve.sh").write_text(SOLVE_SH)
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
                                lines_removed=len(removed.splitlines())),
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
        if check is not None:
            got = check(tmp)
            if not got.ok:
                raise GraderRejects("; ".join(got.problems).replace(str(tmp), tid))
    return final


class LeakFound(Exception):
    """The leak probe found the deleted code somewhere a task's sandbox can read."""


class GraderRejects(Exception):
    """The grader judged the staged task otherwise than the factory's test runs did (the gold patch
    earns no reward, or the start already does); the message is the check's problems."""

