"""Memory snapshots: a sandbox's running processes saved and brought back, not only its files.

Two mechanisms, one record (``MemorySnapshot``: saved process image + the file snapshot
taken at the same instant):

- ``gvisor`` backend: ``GVisorSandbox.start(cmd)`` runs a long-lived process tree,
  ``checkpoint(id)`` saves it with ``runsc checkpoint`` and ``restore_checkpoint(snap)``
  brings it back in a *new* sandbox (files forked from the snapshot). gVisor saves its
  own user-space kernel, so no host kernel support is needed.
- CRIU (``criu dump``/``criu restore``) for processes on the host kernel (the ``local``
  backend's). CRIU needs kernel features (and a CRIU that knows the kernel's vDSO);
  ``criu_unavailable_reason()`` runs ``criu check`` and every entry point raises
  ``CheckpointUnavailable`` with CRIU's own words where it cannot work. On the 2-core
  dev VM (kernel 6.18, Debian's CRIU 3.17.1) that is:
  ``vdso: Unexpected rt vDSO area bounds`` ... ``Could not initialize kernel features detection``.

Test: ``pytest tests/unit/sandbox/test_criu.py -q``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from opencomposer.sandbox.base import SandboxUnavailable


class CheckpointUnavailable(SandboxUnavailable):
    """Process checkpoints cannot be taken here (the message says why, in CRIU's words)."""


@dataclass
class MemorySnapshot:
    """A saved process tree (``image_dir``) and the workspace snapshot (``fs_snapshot``)
    of the sandbox it came from, taken while the processes were frozen."""

    backend: str
    image_dir: Path
    fs_snapshot: str
    config: dict[str, Any] = field(default_factory=dict)  # how to recreate the container (gvisor)
    pid: int | None = None  # the root of the saved tree (criu)


def find_criu() -> str | None:
    return shutil.which("criu") or next((p for p in ("/usr/sbin/criu", "/sbin/criu") if os.path.isfile(p)), None)


@lru_cache(maxsize=None)
def criu_unavailable_reason(criu: str | None = None) -> str | None:
    """None if ``criu check`` passes here, else why not: CRIU's error lines, verbatim."""
    criu = criu or find_criu()
    if not criu:
        return "criu not found: apt-get install -y criu (Linux only)"
    if os.geteuid() != 0:
        return "criu needs root (or CAP_CHECKPOINT_RESTORE + CAP_SYS_PTRACE) to dump and restore processes"
    try:
        r = subprocess.run([criu, "check"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"criu check could not run: {e}"
    if r.returncode != 0:
        lines = [ln for ln in (r.stderr + r.stdout).decode(errors="replace").splitlines() if ln.strip()]
        return f"CRIU cannot checkpoint on this kernel ({os.uname().release}): " + " | ".join(lines[-4:])
    return None


def _require_criu() -> str:
    reason = criu_unavailable_reason()
    if reason:
        raise CheckpointUnavailable(reason)
    return find_criu()  # type: ignore[return-value]


def criu_dump(pid: int, image_dir: Path, *, leave_running: bool = False) -> None:
    """Save the process tree rooted at ``pid`` (a session leader, as sandbox jobs are) to ``image_dir``."""
    criu = _require_criu()
    image_dir.mkdir(parents=True, exist_ok=True)
    args = [criu, "dump", "-t", str(pid), "-D", str(image_dir), "--shell-job", "--tcp-established", "--file-locks"]
    if leave_running:
        args.append("--leave-running")
    r = subprocess.run(args + ["-o", "dump.log"], capture_output=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"criu dump of pid {pid} failed: {_log_tail(image_dir / 'dump.log', r)}")


def criu_restore(image_dir: Path) -> int:
    """Bring a saved tree back, detached; returns the pid of its root."""
    criu = _require_criu()
    pidfile = image_dir / "restored.pid"
    args = [criu, "restore", "-D", str(image_dir), "--shell-job", "--tcp-established", "--file-locks",
            "--restore-detached", "--pidfile", str(pidfile), "-o", "restore.log"]
    r = subprocess.run(args, capture_output=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"criu restore from {image_dir} failed: {_log_tail(image_dir / 'restore.log', r)}")
    return int(pidfile.read_text().strip())


def _log_tail(log: Path, r: subprocess.CompletedProcess) -> str:
    text = log.read_text(errors="replace") if log.exists() else (r.stderr + r.stdout).decode(errors="replace")
    errors = [ln for ln in text.splitlines() if "Error" in ln] or text.splitlines()
    return " | ".join(errors[-4:])


def checkpoint_local(sandbox: Any, pid: int, *, leave_running: bool = False) -> MemorySnapshot:
    """CRIU snapshot of a process tree a ``local`` sandbox started (``setsid cmd &``), with
    a file snapshot of the same instant. Restore with ``restore_local`` into the same
    sandbox: CRIU reopens files at their saved host paths, and a fork's workspace lies
    elsewhere, so a *new* sandbox needs the ``gvisor`` backend's ``restore_checkpoint``."""
    _require_criu()
    fs = sandbox.snapshot()  # CRIU freezes the tree while it dumps; take files just before
    image = Path(sandbox._root) / "checkpoints" / fs
    criu_dump(pid, image, leave_running=leave_running)
    return MemorySnapshot(backend=sandbox.backend, image_dir=image, fs_snapshot=fs, pid=pid)


def restore_local(sandbox: Any, snap: MemorySnapshot) -> int:
    """Files back to ``snap``, then its processes; returns the restored root pid."""
    _require_criu()
    sandbox.restore(snap.fs_snapshot)
    return criu_restore(snap.image_dir)
