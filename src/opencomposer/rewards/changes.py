"""What an episode changed in the workspace: the files, from git, measured in the sandbox.

    changes = workspace_changes(task.workspace, sandbox)
    changes.files     # [("M", "toolz/itertoolz.py"), ("A", "notes.txt"), ...]

Task workspaces are single-commit git repositories (``tasks/leakage.py``). The base
commit is read on the host from the task's own workspace, so an agent that commits,
resets or rewrites ``.git`` inside its sandbox cannot hide a change: the diff is taken
against the base commit, untracked files are listed too, and a moved ``HEAD`` is
reported (``head_moved``), which the hacking monitors flag.

Test: ``pytest tests/unit/rewards/test_shaping.py``.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.protocols import Sandbox

GIT = "git -c safe.directory='*' -c core.quotepath=off"


@dataclass
class Changes:
    files: list[tuple[str, str]] = field(default_factory=list)  # (status letter, path)
    head_moved: bool = False
    error: str = ""  # why the changes could not be listed ("" when they were)

    @property
    def paths(self) -> list[str]:
        return [p for _, p in self.files]

    def to_dict(self) -> dict:
        return {"files": [list(f) for f in self.files], "head_moved": self.head_moved, "error": self.error}

    @classmethod
    def from_dict(cls, d: dict) -> "Changes":
        return cls([tuple(f) for f in d["files"]], d["head_moved"], d["error"])


def base_commit(workspace: Path) -> str | None:
    """The commit the task's workspace starts at (None if it is not a git repository)."""
    try:
        out = subprocess.run(["git", "-c", "safe.directory=*", "rev-parse", "HEAD"], cwd=workspace,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def workspace_changes(workspace: Path, sandbox: Sandbox, timeout: float = 60.0) -> Changes:
    base = base_commit(workspace)
    if base is None:
        return Changes(error=f"{workspace} is not a git repository; changes not listed")
    cmd = (f"{GIT} diff --no-renames --name-status {base} -- . && echo '--untracked--' && "
           f"{GIT} ls-files --others --exclude-standard && echo '--head--' && {GIT} rev-parse HEAD")
    res = sandbox.exec(cmd, timeout=timeout)
    if res.exit_code != 0 or "--head--" not in res.output:
        return Changes(error=f"git in the sandbox failed (exit {res.exit_code}): {res.output[-300:]}")
    tracked, rest = res.output.split("--untracked--", 1)
    untracked, head = rest.split("--head--", 1)
    files = []
    for line in tracked.splitlines():
        status, _, path = line.partition("\t")
        if path:
            files.append((status[:1], path))
    files += [("A", p) for p in untracked.splitlines() if p.strip()]
    return Changes(files=files, head_moved=head.strip() != base)
