"""Helpers for the sandbox tests: host process lookup and a tree digest (no fixtures here)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from opencomposer.sandbox.namespace import unavailable_reason

NS_REASON = unavailable_reason()
NEEDS_NS = [pytest.mark.namespace, pytest.mark.skipif(NS_REASON is not None, reason=str(NS_REASON))]


def tree_digest(root: Path) -> str:
    """Names, link targets, modes and contents of everything under ``root``."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = Path(dirpath, name)
            st = p.lstat()
            h.update(f"{p.relative_to(root)}\0{st.st_mode}\0".encode())
            if p.is_symlink():
                h.update(os.readlink(p).encode())
            elif p.is_file():
                h.update(p.read_bytes())
    return h.hexdigest()


def host_pids(token: str) -> list[int]:
    """Live (non-zombie) host processes whose command line contains ``token``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token in cmd and state != "Z":
            out.append(int(name))
    return out


def wait_gone(token: str, seconds: float = 3.0) -> list[int]:
    """Poll until no process mentions ``token`` (kernel teardown is not instant)."""
    end = time.monotonic() + seconds
    while (pids := host_pids(token)) and time.monotonic() < end:
        time.sleep(0.05)
    return pids


def wait_present(token: str, seconds: float = 3.0) -> list[int]:
    """Poll until a process mentions ``token`` (a background job starts asynchronously)."""
    end = time.monotonic() + seconds
    while not (pids := host_pids(token)) and time.monotonic() < end:
        time.sleep(0.05)
    return pids


def ppid(pid: int) -> int | None:
    """The parent of a host process (None once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
