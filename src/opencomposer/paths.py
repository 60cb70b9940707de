"""Where opencomposer keeps caches (``$OPENCOMPOSER_CACHE`` or ``~/.cache/opencomposer``), and
how it writes files and directories so that a crash never leaves half of one behind.

Temp dirs beside their final path are named ``.<name>.tmp-<host>-<pid>-<rand>`` (``temp_dir``):
hidden, so no reader lists them, and owned, so the next run can tell a dead writer's leftover
(``remove_stale_temps``) from one a live process is still filling.

Test: ``pytest tests/unit/test_paths.py``.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def cache_dir(*parts: str) -> Path:
    # an empty $OPENCOMPOSER_CACHE (``VAR= cmd``, ``${VAR:-}``) means unset, not the current directory
    root = Path(os.environ.get("OPENCOMPOSER_CACHE") or Path.home() / ".cache" / "opencomposer")
    p = root.joinpath(*parts)
    p.mkdir(parents=True, exist_ok=True)
    return p


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temp file + rename: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """``atomic_write_bytes`` of ``text`` (UTF-8)."""
    atomic_write_bytes(path, text.encode())


# A temp dir of another host cannot be checked for a live owner; past this age it is a leftover.
FOREIGN_STALE_S = 24 * 3600.0
_TEMP = re.compile(r"^\..*\.(?:tmp|old)-(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:32] or "host"


def temp_name(final: Path, kind: str = "tmp") -> Path:
    """``final``'s sibling ``.<name>.<kind>-<host>-<pid>-<rand>``: hidden, and naming its owner."""
    return final.with_name(f".{final.name[:60]}.{kind}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def temp_dir(final: Path) -> Path:
    """A new empty dir beside ``final`` (``temp_name``), to be renamed to it once complete."""
    tmp = temp_name(final)
    tmp.mkdir()
    return tmp


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def is_stale_temp(path: Path) -> bool:
    """Whether ``path`` is a ``temp_name`` whose owner is dead (this host: its pid is gone;
    another host: older than ``FOREIGN_STALE_S``)."""
    m = _TEMP.match(path.name)
    if not m:
        return False
    if m["host"] == _host():
        return int(m["pid"]) != os.getpid() and not _pid_alive(int(m["pid"]))
    try:
        return time.time() - path.lstat().st_mtime > FOREIGN_STALE_S
    except FileNotFoundError:
        return False


def remove_stale_temps(parent: Path) -> list[str]:
    """Remove the temp dirs and files of dead writers directly under ``parent``; returns their names."""
    gone: list[str] = []
    try:
        entries = list(Path(parent).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return gone
    for p in entries:
        if is_stale_temp(p):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            gone.append(p.name)
    return gone


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` is swapped out first (so ``final`` is
    missing for one rename at most, never half-made) and then removed."""
    if final.exists() or final.is_symlink():
        old = temp_name(final, "old")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Build a directory in a temp dir beside ``final`` (``temp_dir``); it replaces ``final``
    only when the block succeeds (a reader never sees half of it), and is removed when the
    block raises. A killed process leaves the temp dir: ``remove_stale_temps`` clears it."""
    final = Path(final)
    tmp = temp_dir(final)
    try:
        yield tmp
        replace_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def held_lock(name: str, shared: bool = False) -> Iterator[None]:
    """A ``flock`` on the cache's ``locks/<name>.lock`` for the block: exclusive, so processes (or
    threads) that would build the same thing take turns; ``shared``, so readers of a built thing
    read together while no builder replaces it under them. The kernel drops it when its holder
    dies, so a killed builder never leaves the next one waiting. A shared holder must not ask for
    the exclusive lock inside its block (it would wait for itself)."""
    fd = os.open(cache_dir("locks") / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
