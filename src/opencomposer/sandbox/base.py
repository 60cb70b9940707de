"""What every sandbox backend shares: running a process, capping its output, the
scrubbed environment, path confinement, tree copies, and the ``SandboxBase`` mixin
(``with`` support, ``reset``).

Backends (``local.py``, ``namespace.py``) differ only in *where* a process runs and
how the workspace is stored; the rules for timeouts, output and paths live here once.

Test: ``pytest tests/unit/sandbox -q``.
"""

from __future__ import annotations

import os
import posixpath
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from opencomposer.protocols import ExecResult, PathEscape, SandboxSpec

INITIAL = "initial"  # snapshot id of the state a sandbox was created in
_CHUNK = 1 << 20  # read size; with a 1 MiB pipe a 1 GB flood is ~1000 reads
_EXIT_GRACE = 0.2  # seconds we keep reading after the main process exits (see run_process)
_TICK = 0.02  # how often the read loop looks at the clock and the process


class SandboxUnavailable(RuntimeError):
    """The chosen backend cannot run on this machine (says what is missing)."""


# --------------------------------------------------------------------------- output


class OutputCap:
    """Keeps the first and last bytes of a stream within ``max_output`` and counts the rest.

    Memory stays O(max_output) however much is fed: the middle is dropped as it arrives.
    Half goes to the head and half to the tail, because for test runs the summary at the
    end matters as much as the first error.
    """

    def __init__(self, max_output: int):
        self.limit = max(0, int(max_output))
        self.tail_limit = self.limit // 2
        self.head_limit = self.limit - self.tail_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes | memoryview) -> None:
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk and self.tail_limit:
            self.tail += chunk[-self.tail_limit :]
            del self.tail[: max(0, len(self.tail) - self.tail_limit)]

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def text(self) -> str:
        if not self.truncated:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace")
        head = bytes(self.head).decode("utf-8", "replace")
        tail = bytes(self.tail).decode("utf-8", "replace")
        omitted = self.total - len(self.head) - len(self.tail)
        middle = f"\n[... {omitted} bytes omitted ...]\n" if tail else "\n"
        return (
            f"{head}{middle}{tail}\n[output truncated: {self.total} bytes total, "
            f"showing first {len(self.head)} and last {len(self.tail)}]"
        )


# --------------------------------------------------------------------------- processes


def shell_argv(command: str | list[str]) -> list[str]:
    """A string runs under bash (sh if the host has no bash); a list runs as is."""
    if isinstance(command, list):
        return list(command)
    return ["bash" if shutil.which("bash") else "sh", "-c", command]


def _feed_stdin(pipe, data: bytes) -> None:
    # A thread, so a command that reads slowly (or never) cannot deadlock the reader.
    try:
        pipe.write(data)
    except (BrokenPipeError, OSError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def run_process(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str | None = None,
    stdin: bytes | None = None,
    timeout: float | None = 60.0,
    max_output: int = 32_000,
    on_start: Callable[[subprocess.Popen], None] | None = None,
    preexec: Callable[[], None] | None = None,
    watch: Callable[[], str | None] | None = None,
    watch_every: float = 0.25,
) -> ExecResult:
    """Run ``argv`` in its own session, stdout+stderr merged and capped, killed at ``timeout``.

    On timeout the whole process group gets SIGKILL (backends whose process tree can
    leave the group, like bwrap's, make sure killing the leader kills the rest).
    After the main process exits we read for at most ``_EXIT_GRACE`` seconds more:
    a background job that keeps the pipe open must not hold the call hostage.

    ``preexec`` runs in the child before exec (rlimits, cgroups); ``watch`` is called
    every ``watch_every`` seconds while the command runs, and a reason it returns kills
    the command the way a timeout does, with ``[killed: <reason>]`` in the output.
    """
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, start_new_session=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            preexec_fn=preexec,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return ExecResult(127, f"failed to start {argv[0]!r}: {e}", seconds=time.monotonic() - start)
    if on_start is not None:
        on_start(proc)
    if stdin is not None:
        threading.Thread(target=_feed_stdin, args=(proc.stdin, stdin), daemon=True).start()
    fd = proc.stdout.fileno()
    if sys.platform.startswith("linux"):
        try:
            import fcntl

            fcntl.fcntl(fd, 1031, _CHUNK)  # F_SETPIPE_SZ: fewer, larger reads for floods
        except OSError:
            pass
    cap, timed_out, exited_at, killed_for = OutputCap(max_output), False, None, None
    next_watch = start + watch_every if watch is not None else float("inf")
    buf = bytearray(_CHUNK)  # reused: a flood must not allocate a fresh chunk per read
    view = memoryview(buf)
    deadline = start + timeout if timeout and timeout > 0 else float("inf")
    # Non-blocking reads, and the clock/poll() checks at most every _TICK: a flood then
    # costs one read syscall per chunk rather than select+read+waitpid.
    os.set_blocking(fd, False)
    next_check, streaming = 0.0, False
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _TICK
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                if exited_at is None and now >= deadline:
                    timed_out = True
                    _kill_group(proc)
                    exited_at = now
                if exited_at is None and now >= next_watch:
                    killed_for = watch()  # type: ignore[misc]
                    next_watch = time.monotonic() + watch_every
                    if killed_for:
                        _kill_group(proc)
                        exited_at = now
                if exited_at is not None and now - exited_at > _EXIT_GRACE:
                    break
            try:
                n = os.readv(fd, [buf])
            except BlockingIOError:
                if streaming:  # let a fast writer fill the pipe: far fewer wakeups
                    time.sleep(0.001)
                    streaming = False
                else:  # EOF wakes us anyway; the clock only matters for deadlines and grace
                    limit = next_check if exited_at is not None else min(deadline, now + 0.1)
                    sel.select(max(0.0, limit - now))
                continue
            if not n:
                break
            streaming = True
            cap.feed(view[:n])
    proc.stdout.close()
    while True:  # a command may close its output and keep running: deadline and watch still hold
        step = min(deadline, next_watch) - time.monotonic()
        try:
            code = proc.wait(timeout=None if step == float("inf") else max(0.0, step))
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                timed_out = True
            elif not (killed_for := watch()):  # type: ignore[misc]
                next_watch = time.monotonic() + watch_every
                continue
            _kill_group(proc)
            code = proc.wait()
            break
    out = cap.text()
    if killed_for:
        out += f"\n[killed: {killed_for}]"
    elif timed_out:
        out += f"\n[timed out after {timeout:g} s: process killed]"
    return ExecResult(code, out, timed_out, cap.truncated, time.monotonic() - start)


def _kill_group(proc: subprocess.Popen) -> None:
    # The leader is not reaped yet (poll() said running), so its pgid cannot be reused.
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


# --------------------------------------------------------------------------- environment


def scrubbed_env(
    spec: SandboxSpec, workdir: str, home: str, env: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment a sandboxed command sees, built from nothing: no host variable leaks."""
    path = "/usr/local/bin:/usr/bin:/bin"
    out = {"HOME": home, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "TERM": "dumb"}
    if spec.env_dir is not None:
        env_dir = os.path.abspath(spec.env_dir)
        path = f"{env_dir}/bin:{path}"
        out["VIRTUAL_ENV"] = env_dir
    out["PATH"] = path
    if spec.pythonpath:
        out["PYTHONPATH"] = ":".join(posixpath.join(workdir, p) for p in spec.pythonpath)
    out.update(spec.extra_env)
    out.update(env or {})
    return out


# --------------------------------------------------------------------------- paths


def confine(path: str, root: str) -> str:
    """``path`` relative to ``root`` ('.' for the root), checked lexically.

    Relative paths are taken from ``root``; absolute ones must lie under it. Symlinks
    are the backend's business (``check_resolved`` on the host, ``realpath`` inside).
    """
    if "\0" in path:
        raise PathEscape(f"path {path!r} contains a NUL byte")
    joined = posixpath.normpath(posixpath.join(root, path or "."))
    if joined != root and not joined.startswith(root.rstrip("/") + "/"):
        raise PathEscape(f"path {path!r} resolves to {joined!r}, outside the workspace {root!r}")
    return posixpath.relpath(joined, root)


def check_resolved(host_path: str, root_real: str, shown: str) -> str:
    """Resolve symlinks on the host and refuse a result outside ``root_real``."""
    real = os.path.realpath(host_path)
    if real != root_real and not real.startswith(root_real.rstrip("/") + "/"):
        raise PathEscape(f"path {shown!r} follows a symlink to {real!r}, outside the workspace")
    return real


# --------------------------------------------------------------------------- trees


def copy_tree(src: Path, dst: Path) -> None:
    """Copy ``src`` to a new ``dst`` keeping links, modes, xattrs and device nodes.

    GNU ``cp -a`` is both faster than Python and the only easy way to keep overlay
    whiteouts (0:0 char devices) and opaque-dir xattrs; elsewhere fall back to shutil.
    """
    if shutil.which("cp") and sys.platform.startswith("linux"):
        r = subprocess.run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dst)], capture_output=True)
        if r.returncode != 0:
            raise OSError(f"copy {src} -> {dst} failed: {r.stderr.decode(errors='replace').strip()}")
        return
    shutil.copytree(src, dst, symlinks=True)


def remove_tree(path: Path) -> None:
    """Remove ``path`` even where modes forbid it (overlay leaves a mode-000 ``work/work``)."""

    def fix(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
        except OSError:
            pass
        func(p)

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=fix)


# --------------------------------------------------------------------------- mixin


class SandboxBase:
    """Behaviour every backend gets for free: ``with`` blocks and ``reset()``."""

    _initial_id: str = INITIAL

    def restore(self, snapshot_id: str) -> None:  # pragma: no cover - backends override
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - backends override
        raise NotImplementedError

    def reset(self) -> None:
        """Back to the state the sandbox was created (or forked) in."""
        self.restore(self._initial_id)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
