"""Running one command with a timeout and an output cap: the process runner of every backend.

``base.run_process`` wraps ``run_capped`` on the host; inside a namespace sandbox the exec
server (``execserver.py``) runs the same function as PID 1. Standard library only, on
purpose: ``execserver.server_code`` ships this module's source into the sandbox, where
``python3 -I -S`` can import nothing of ours.

Test: ``pytest tests/unit/sandbox/test_sandbox_base.py tests/unit/sandbox/test_adversarial.py -q``.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading
import time

CHUNK = 1 << 20  # read size; with a 1 MiB pipe a 1 GB flood is ~1000 reads
EXIT_GRACE = 0.2  # seconds we keep reading after the main process exits (see run_capped)
TICK = 0.02  # how often the read loop looks at the clock and the process


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

    @classmethod
    def from_parts(cls, limit: int, head: bytes, tail: bytes, total: int) -> OutputCap:
        """A cap as another process left it (the exec server sends head, tail and total)."""
        cap = cls(limit)
        cap.head, cap.tail, cap.total = bytearray(head), bytearray(tail), total
        return cap

    def feed(self, chunk) -> None:
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


def observation(cap: OutputCap, timed_out: bool, killed_for: str | None, timeout: float | None) -> str:
    """The capped output plus the line saying why the command was killed, if it was."""
    out = cap.text()
    if killed_for:
        out += f"\n[killed: {killed_for}]"
    elif timed_out:
        out += f"\n[timed out after {timeout:g} s: process killed]"
    return out


# --------------------------------------------------------------------------- processes


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


def kill_group(proc: subprocess.Popen) -> None:
    # The leader is not reaped yet (poll() said running), so its pgid cannot be reused.
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def run_capped(argv, *, env, cwd=None, stdin=None, timeout=60.0, max_output=32_000, on_start=None,
               preexec=None, watch=None, watch_every=0.25):
    """Run ``argv`` in its own session, stdout+stderr merged and capped, killed at ``timeout``.

    Returns ``(exit_code, cap, timed_out, killed_for, seconds)``; exit code 127 with the
    error as output if it cannot start. On timeout the whole process group gets SIGKILL.
    After the main process exits we read for at most ``EXIT_GRACE`` seconds more: a
    background job that keeps the pipe open must not hold the call hostage.

    ``preexec`` runs in the child before exec (rlimits, cgroups); ``watch`` is called
    every ``watch_every`` seconds while the command runs, and a reason it returns kills
    the command the way a timeout does.
    """
    start = time.monotonic()
    cap = OutputCap(max_output)
    try:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, start_new_session=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            preexec_fn=preexec,
        )
    except (OSError, subprocess.SubprocessError) as e:
        cap.feed(f"failed to start {argv[0]!r}: {e}".encode())
        return 127, cap, False, None, time.monotonic() - start
    if on_start is not None:
        on_start(proc)
    if stdin is not None:
        threading.Thread(target=_feed_stdin, args=(proc.stdin, stdin), daemon=True).start()
    fd = proc.stdout.fileno()
    if sys.platform.startswith("linux"):
        try:
            import fcntl

            fcntl.fcntl(fd, 1031, CHUNK)  # F_SETPIPE_SZ: fewer, larger reads for floods
        except OSError:
            pass
    timed_out, exited_at, killed_for = False, None, None
    next_watch = start + watch_every if watch is not None else float("inf")
    buf = bytearray(CHUNK)  # reused: a flood must not allocate a fresh chunk per read
    view = memoryview(buf)
    deadline = start + timeout if timeout and timeout > 0 else float("inf")
    # Non-blocking reads, and the clock/poll() checks at most every TICK: a flood then
    # costs one read syscall per chunk rather than select+read+waitpid.
    os.set_blocking(fd, False)
    next_check, streaming = 0.0, False
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + TICK
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                if exited_at is None and now >= deadline:
                    timed_out = True
                    kill_group(proc)
                    exited_at = now
                if exited_at is None and now >= next_watch:
                    killed_for = watch()
                    next_watch = time.monotonic() + watch_every
                    if killed_for:
                        kill_group(proc)
                        exited_at = now
                if exited_at is not None and now - exited_at > EXIT_GRACE:
                    break
            try:
                n = os.readv(fd, [buf])
            except BlockingIOError:
                if streaming:  # let a fast writer fill the pipe: far fewer wakeups
                    time.sleep(0.001)
                    streaming = False
                else:  # EOF wakes us anyway; the clock only matters for deadlines and grace
                    limit = next_check if exited_at is not None else min(deadline, next_watch, now + 0.1)
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
            elif not (killed_for := watch()):
                next_watch = time.monotonic() + watch_every
                continue
            kill_group(proc)
            code = proc.wait()
            break
    return code, cap, timed_out, killed_for, time.monotonic() - start
