"""What an episode changed in the workspace: the files, from git, measured in the sandbox.

    changes = workspace_changes(task.workspace, sandbox)
    changes.files     # [("M", "toolz/itertoolz.py"), ("A", "notes.txt"), ...]

Task workspaces are single-commit git repositories (``tasks/leakage.py``); one that is not
(a hand-made fixture, an imported task) is compared file by file by hash instead. The base
commit is read on the host from the task's own workspace, so an agent that commits,
resets or rewrites ``.git`` inside its sandbox cannot hide a change: the diff is taken
against the base commit, untracked files are listed too, and a moved ``HEAD`` is
reported (``head_moved``), which the hacking monitors flag.

Test: ``pytest tests/unit/rewards/test_shaping.py``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.protocols import Sandbox

# the workspace's own git config may name hooks or an fsmonitor command: none of them runs for us
GIT = "git -c safe.directory='*' -c core.quotepath=off -c core.fsmonitor=false -c core.hooksPath=/dev/null"
HASH_CMD = ("find . -path ./.git -prune -o \\( -type f -o -type l \\) -print0 | xargs -0 -r sha256sum --")


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
    """The commit the task's workspace starts at (None if it is not a git repository of its own:
    a workspace inside another repository, like the shipped fixtures, is not one)."""
    if not (workspace / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-c", "safe.directory=*", "rev-parse", "HEAD"], cwd=workspace,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def workspace_changes(workspace: Path, sandbox: Sandbox, timeout: float = 60.0) -> Changes:
    """The files the episode changed, from git where the workspace is a repository (else, or when
    git fails in the sandbox, by hashing every file against the base: ``hashed_changes``)."""
    base = base_commit(workspace)
    if base is None:
        return hashed_changes(workspace, sandbox, timeout)
    cmd = (f"{GIT} diff --no-renames --name-status {base} -- . && echo '--untracked--' && "
           f"{GIT} ls-files --others --exclude-standard && echo '--head--' && {GIT} rev-parse HEAD")
    res = sandbox.exec(cmd, timeout=timeout)
    if res.exit_code != 0 or "--head--" not in res.output:
        found = hashed_changes(workspace, sandbox, timeout)
        found.error = found.error or f"git in the sandbox failed (exit {res.exit_code}); listed by hashing"
        return found
    tracked, rest = res.output.split("--untracked--", 1)
    untracked, head = rest.split("--head--", 1)
    files = []
    for line in tracked.splitlines():
        status, _, path = line.partition("\t")
        if path:
            files.append((status[:1], path))
    files += [("A", p) for p in untracked.splitlines() if p.strip()]
    return Changes(files=files, head_moved=head.strip() != base)


def _host_hashes(workspace: Path) -> dict[str, str]:
    out = {}
    for p in workspace.rglob("*"):
        rel = p.relative_to(workspace)
        if rel.parts[0] == ".git" or not (p.is_file() or p.is_symlink()):
            continue
        data = os.readlink(p).encode() if p.is_symlink() else p.read_bytes()
        out[rel.as_posix()] = hashlib.sha256(data).hexdigest()
    return out


def hashed_changes(workspace: Path, sandbox: Sandbox, timeout: float = 60.0) -> Changes:
    """Changes without git: every file's SHA-256 in the sandbox against the base on the host
    (a symlink in the base is compared by its target's name; ``.git`` is left out)."""
    res = sandbox.exec(HASH_CMD, timeout=timeout, max_output=64_000_000)
    if res.exit_code != 0 or res.truncated:
        return Changes(error=f"listing the workspace's files failed (exit {res.exit_code}): {res.output[-300:]}")
    now = {}
    for line in res.output.splitlines():
        digest, _, path = line.partition("  ")
        if path.startswith("./") and not digest.startswith("\\"):  # sha256sum escapes odd names: skip them
            now[path[2:]] = digest
    base = _host_hashes(workspace)
    files = [("M", p) for p in sorted(now) if p in base and now[p] != base[p]]
    files += [("A", p) for p in sorted(now) if p not in base]
    files += [("D", p) for p in sorted(base) if p not in now]
    return Changes(files=files)
