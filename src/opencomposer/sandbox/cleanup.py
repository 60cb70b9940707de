"""What a killed sandbox host leaves behind, found and removed when a host starts again.

Every namespace and local sandbox writes a record to a per-host state dir before it makes
anything: ``<state>/<sandbox-id>.json`` names its temp dir, its cgroups and the lock
file of the process that owns it. The owner holds an exclusive ``flock`` on
``owner-<pid>.lock`` for as long as it lives; the kernel drops that lock however the
process dies (SIGKILL included), and a reused pid cannot hold it. So a record whose
owner lock can be taken belongs to a dead owner, and ``reap()`` removes what it names:
processes (those in its cgroups, any whose command line names its temp dir, and for a
local sandbox those carrying its ``OPENCOMPOSER_SANDBOX`` marker), the cgroups, the size-capped tmpfs of its workspace changes (``mount_disk``), the temp dir,
the record.

Processes rarely survive their owner (a namespace sandbox's exec server exits when its
control pipe closes, and its namespace's processes die with it); temp dirs and cgroup
dirs always do, and this is what clears them.

``reap()`` runs once per process before its first namespace or local sandbox is made, and on
demand: ``python -m opencomposer.sandbox.cleanup`` (prints one JSON line).

Test: ``pytest tests/unit/sandbox/test_cleanup.py tests/unit/sandbox/test_local.py -q``.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

from opencomposer.paths import atomic_write_text, cache_dir
from opencomposer.sandbox.base import remove_tree

STATE_ENV = "OPENCOMPOSER_SANDBOX_STATE"
_lock = threading.Lock()
_owner: dict[str, object] = {}  # "pid:state" -> (fd, path) of the lock this process holds
_live: dict[str, int] = {}  # "pid:state" -> records this process has not unregistered yet
_reaped_in: set[int] = set()


MARKER = "OPENCOMPOSER_SANDBOX"


def _marked_pids(marker: bytes) -> list[int]:
    """Pids of live processes whose environment holds ``marker`` (Linux /proc only)."""
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for name in entries:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    pids.append(int(name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def kill_marked(sandbox_id: str) -> int:
    """SIGKILL every process started by local sandbox ``sandbox_id`` (its marker in the
    environment); returns how many."""
    marker, killed = f"{MARKER}={sandbox_id}".encode(), set()
    for _ in range(5):  # a dying shell may fork once more; sweep until quiet
        pids = _marked_pids(marker)
        if not pids:
            break
        _sigkill(pids, killed)
    return len(killed)


def _sigkill(pids, killed: set[int]) -> None:
    """SIGKILL each of ``pids``, adding those signalled to ``killed`` (gone or not ours: skipped)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        except (ProcessLookupError, PermissionError):
            pass


def state_dir() -> Path:
    """``$OPENCOMPOSER_SANDBOX_STATE``, else ``<cache>/sandbox-state/<hostname>``."""
    env = os.environ.get(STATE_ENV)
    if env:
        p = Path(env)
        p.mkdir(parents=True, exist_ok=True)
        return p
    return cache_dir("sandbox-state", socket.gethostname())


def _owner_lock(state: Path) -> Path:
    """This process's lock file, created and locked on first use (again after a fork).

    Counts one more live record under the same lock, so a concurrent ``unregister`` of
    the last other record cannot drop the lock this record is about to name.
    """
    pid = os.getpid()
    key = f"{pid}:{state}"
    with _lock:
        held = _owner.get(key)
        if held is not None:
            _live[key] = _live.get(key, 0) + 1
            return held[1]  # type: ignore[index]
        path = state / f"owner-{pid}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            # A dead process of the same pid may have left this file: flock is what counts.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RuntimeError(f"sandbox owner lock {path} is held by another live process") from None
        _owner[key] = (fd, path)
        _live[key] = _live.get(key, 0) + 1
        return path


def register(sandbox_id: str, root: Path, cgroups: list[str], backend: str = "namespace") -> Path:
    """Record a sandbox before its resources exist; returns the record's path."""
    state = state_dir()
    record = state / f"{sandbox_id}.json"
    body = {"id": sandbox_id, "backend": backend, "owner_pid": os.getpid(), "owner_lock": str(_owner_lock(state)),
            "root": str(root), "cgroups": list(cgroups), "created": time.time()}
    atomic_write_text(record, json.dumps(body))
    return record


def unregister(record: Path) -> None:
    """Drop a record; the owner lock goes with this process's last one."""
    try:
        record.unlink()
    except FileNotFoundError:
        return
    key = f"{os.getpid()}:{record.parent}"
    with _lock:
        if key not in _live:
            return
        _live[key] -= 1
        if _live[key] <= 0:
            del _live[key]
            fd, path = _owner.pop(key)  # type: ignore[misc]
            Path(path).unlink(missing_ok=True)
            os.close(fd)


def _owner_alive(lock_path: str) -> bool:
    if any(held[1] == Path(lock_path) for held in _owner.values()):  # type: ignore[index]
        return True
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the probe lock at once
    return False


def pids_naming(text: str) -> list[int]:
    """Live host processes whose command line contains ``text`` (e.g. a sandbox's temp dir)."""
    needle, me, out = text.encode(), os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if needle in f.read():
                    out.append(int(name))
        except OSError:
            continue
    return out


def cgroup_pids(cgroup: str) -> list[int]:
    try:
        return [int(x) for x in Path(cgroup, "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def kill_sandbox_processes(root: str | None, cgroups: list[str], seconds: float = 5.0) -> int:
    """SIGKILL everything in ``cgroups`` and every process naming ``root``; returns how many."""
    killed: set[int] = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pids = {p for cg in cgroups for p in cgroup_pids(cg)} | set(pids_naming(root) if root else ())
        pids.discard(os.getpid())
        if not pids:
            break
        _sigkill(pids, killed)
        time.sleep(0.02)
    return len(killed)


def remove_cgroups(cgroups: list[str], seconds: float = 5.0) -> int:
    """rmdir each cgroup once its processes are gone; returns how many were removed."""
    removed = 0
    for cg in cgroups:
        end = time.monotonic() + seconds
        while os.path.isdir(cg):
            try:
                os.rmdir(cg)
                removed += 1
            except OSError:
                if time.monotonic() > end:
                    break
                time.sleep(0.02)  # dying tasks still count until fully exited
    return removed


DISK = "disk"  # a sandbox dir's size-capped tmpfs for its workspace changes (namespace.py)


@functools.cache
def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)  # the interpreter's own symbols: libc's mount/umount2


def mount_disk(root: Path, nbytes: int) -> Path | None:
    """A tmpfs of ``nbytes`` at ``root/disk`` (needs CAP_SYS_ADMIN: root), or None where
    the host does not let us mount (then the caller keeps files on the host's disk)."""
    point = root / DISK
    point.mkdir()
    try:
        libc = _libc()
        ok = libc.mount(b"tmpfs", str(point).encode(), b"tmpfs", 0x2 | 0x4,  # MS_NOSUID | MS_NODEV
                        f"size={nbytes},mode=0700".encode()) == 0
    except (OSError, AttributeError):
        ok = False
    if not ok:
        point.rmdir()
        return None
    return point


def unmount_disk(root: Path) -> None:
    """Detach ``root/disk`` if it is mounted (no-op otherwise)."""
    point = root / DISK
    if os.path.ismount(point):
        _libc().umount2(str(point).encode(), 2)  # MNT_DETACH


# Another process may be writing a record right now (``atomic_write_text``: tmp, then rename):
# deleting its tmp file made that process's register() fail (seen in CI: an eval episode
# errored with FileNotFoundError on the rename while a new process reaped).
TMP_GRACE_S = 60.0


COUNTS = ("sandboxes", "processes", "cgroups", "dirs")  # what ``reap`` and ``reap_own`` count


def _records(state: Path):
    """(record path, body) of each readable sandbox record, its ``cgroups`` a list; others are skipped
    (half-written by a dying owner: atomic writes make that a tmp file, not a record)."""
    for record in sorted(state.glob("*.json")):
        try:
            body = json.loads(record.read_text())
            if not isinstance(body, dict) or "owner_lock" not in body or "root" not in body:
                continue
            body["cgroups"] = list(body.get("cgroups", []))
        except (OSError, ValueError, TypeError):
            continue
        yield record, body


def reap(state: Path | None = None) -> dict[str, int]:
    """Remove every sandbox whose owner is dead; returns counts of what went."""
    state = state or state_dir()
    counts = dict.fromkeys(COUNTS, 0)
    locks_in_use: set[str] = set()
    for record, body in _records(state):
        if _owner_alive(body["owner_lock"]):
            locks_in_use.add(body["owner_lock"])
            continue
        _remove(record, body, counts)
    for lock in state.glob("owner-*.lock"):  # locks of dead owners with no records left
        if str(lock) not in locks_in_use and not _owner_alive(str(lock)):
            lock.unlink(missing_ok=True)
    for tmp in state.glob(".*.json.tmp"):  # a dead writer's leftovers; a live one renames within ms
        try:
            if time.time() - tmp.stat().st_mtime > TMP_GRACE_S:
                tmp.unlink(missing_ok=True)
        except FileNotFoundError:
            continue
    return counts


def _remove(record: Path, body: dict, counts: dict[str, int]) -> None:
    """One recorded sandbox gone: its processes, cgroups, disk, directory and record."""
    root, cgroups = body["root"], body["cgroups"]
    if body.get("backend") == "local":  # its processes carry its marker, not its dir, in argv
        counts["processes"] += kill_marked(str(body.get("id", "")))
    counts["processes"] += kill_sandbox_processes(root, cgroups)
    counts["cgroups"] += remove_cgroups(cgroups)
    if os.path.lexists(root):
        unmount_disk(Path(root))
        remove_tree(Path(root))
        counts["dirs"] += 1
    record.unlink(missing_ok=True)
    counts["sandboxes"] += 1


def reap_own(state: Path | None = None) -> dict[str, int]:
    """Every sandbox this process recorded, removed now, as ``reap`` removes a dead owner's: for a
    process about to end without unwinding (the CLI's SIGTERM, ``cli.main``), so nothing it started
    runs on (a local sandbox's graders would, to their own end, as their timeouts died with it).
    Takes no lock of this module: it may run in a signal handler that interrupted one."""
    state = state or state_dir()
    counts = dict.fromkeys(COUNTS, 0)
    for record, body in _records(state):
        if body.get("owner_pid") == os.getpid():
            _remove(record, body, counts)
    return counts


def reap_once() -> None:
    """``reap()`` the first time a process calls it (sandbox constructors do)."""
    pid = os.getpid()
    if pid in _reaped_in:
        return
    _reaped_in.add(pid)
    reap()


if __name__ == "__main__":
    print(json.dumps({"state_dir": str(state_dir()), **reap()}))
