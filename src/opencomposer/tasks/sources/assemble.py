"""Write one opencomposer task directory from parts, atomically, and the diffs it needs.

Every importer ends here: a workspace tree, hidden test files, a gold patch, an
instruction and a ``TaskMeta`` become ``OUT/<id>/`` (built in a temp dir beside it and
renamed into place, so a crash leaves no half task; a dead writer's temp dir goes on the
next write). The workspace is scrubbed of leak channels and gets a fresh single-commit git
history, as ``tasks make`` does. Before the rename the task passes ``format.check_paths``:
an imported task whose id, files, targets, pythonpath or env lead outside it is refused
(``TaskFormatError`` naming the key and the path), and an env given from elsewhere is linked
into ``OUT/_envs`` (``envs.adopt_env``), the one place outside a task its env may be.

Test: ``pytest tests/unit/tasks/sources/test_assemble.py tests/unit/tasks/sources/test_confine.py``.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from opencomposer.paths import remove_stale_temps, staged_dir
from opencomposer.tasks import leakage
from opencomposer.tasks.deletion import make_patch
from opencomposer.tasks.envs import adopt_env, build_env
from opencomposer.tasks.format import (
    ENVS,
    TaskMeta,
    check_paths,
    check_task_id,
    write_task_toml,
)
from opencomposer.tasks.layout import inspect_project
from opencomposer.tasks.pypi import SourceError

SOLVE_SH = "#!/bin/sh\n# run from the workspace root\nexec patch -p1 < \"$(dirname \"$0\")/gold.patch\"\n"


def runner_sh(command: str, targets: list[str]) -> str:
    return ("#!/bin/sh\n# copy tests/files over the workspace first; run from the workspace root\n"
            f"exec {command} {' '.join(shlex.quote(t) for t in targets)}\n")


def file_diff(rel: str, old: str | None, new: str | None) -> str:
    """Git-style unified diff of one file from ``old`` to ``new`` (None: the file is absent)."""
    if old is not None and new is not None:
        return make_patch(new, old, rel)  # make_patch(before, after) turns after into before
    text = new if old is None else old
    lines = text.splitlines(keepends=True)
    if not lines:
        return ""  # an empty file added or removed: nothing a unified diff can carry
    sign, hunk = ("+", f"@@ -0,0 +1,{len(lines)} @@\n") if old is None else ("-", f"@@ -1,{len(lines)} +0,0 @@\n")
    head = (f"diff --git a/{rel} b/{rel}\n" + ("new file mode 100644\n--- /dev/null\n" f"+++ b/{rel}\n"
            if old is None else f"deleted file mode 100644\n--- a/{rel}\n+++ /dev/null\n"))
    body = "".join(sign + (l if l.endswith("\n") else l + "\n\\ No newline at end of file\n") for l in lines)
    return head + hunk + body


def tree_files(root: Path) -> dict[str, bytes]:
    """rel path -> bytes of every regular file under ``root`` (``.git`` excluded)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != ".git")
        for name in sorted(filenames):
            p = Path(dirpath, name)
            if p.is_file() and not p.is_symlink():
                out[p.relative_to(root).as_posix()] = p.read_bytes()
    return out


def source_env(root: Path, name: str, out: Path, env: Path | None = None) -> Path:
    """The Python env for tasks from the tree ``root``: ``env`` if given, else one built
    (or reused) at ``OUT/_envs/<name>`` from the project's declared test requirements."""
    if env is not None:
        if not Path(env).is_dir():
            raise SourceError(f"--env {env}: not a directory (expected a Python env with pytest)")
        return Path(env).resolve()
    return build_env(inspect_project(root), name, out / "_envs" / name)


def write_task_dir(out: Path, meta: TaskMeta, instruction: str, workspace: Path | None,
                   hidden: dict[str, bytes], gold_patch: str, workspace_files: dict[str, bytes] | None = None,
                   drop: list[str] = (), env: Path | None = None) -> Path:
    """Assemble ``OUT/<meta.id>/``; the workspace is a copy of ``workspace`` (a tree) or
    ``workspace_files``; ``drop`` lists workspace files to remove (tests that reveal the
    answer); ``env`` is written into ``meta.environment.env`` relative to the task."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    check_task_id(meta.id, f"{out / meta.id / 'task.toml'}")
    if env is not None:
        env = adopt_env(out, Path(env))
        meta = meta.model_copy(update={"environment": meta.environment.model_copy(
            update={"env": f"../{ENVS}/{os.path.relpath(env, out / ENVS)}"})})
    check_paths(out / meta.id, meta, out / meta.id / "task.toml")  # before a file is written
    remove_stale_temps(out)
    final = out / meta.id
    with staged_dir(final) as tmp:
        ws = tmp / "workspace"
        if workspace is not None:
            shutil.copytree(workspace, ws, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        else:
            ws.mkdir()
        for rel, data in (workspace_files or {}).items():
            (ws / rel).parent.mkdir(parents=True, exist_ok=True)
            (ws / rel).write_bytes(data)
        for rel in drop:
            (ws / rel).unlink(missing_ok=True)
        leakage.scrub_workspace(ws)
        leakage.fresh_git(ws)
        for rel, data in hidden.items():
            dst = tmp / "tests" / "files" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
        (tmp / "tests" / "test.sh").write_text(runner_sh(meta.tests.command, meta.tests.targets))
        (tmp / "solution").mkdir()
        (tmp / "solution" / "gold.patch").write_text(gold_patch)
        (tmp / "solution" / "solve.sh").write_text(SOLVE_SH)
        (tmp / "instruction.md").write_text(instruction.strip() + "\n")
        write_task_toml(tmp / "task.toml", meta)
        check_paths(tmp, meta, final / "task.toml")  # the files as written: no symlink out either
    return final
