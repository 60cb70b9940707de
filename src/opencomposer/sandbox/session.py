"""The host's end of a namespace sandbox's exec server: one bwrap process and two pipes.

    session = ExecSession.spawn(bwrap_prefix(...), server_python(env_dir), limiter, root)
    session.recv(30.0)                                   # its hello
    session.send({"op": "exec", "argv": ["true"], ...}); header, body = session.recv(90.0)

The server (``execserver.py``, stdlib Python) runs as PID 1 of the sandbox's namespaces;
requests and replies are frames on its stdin and stdout. ``recv`` waits with ``poll`` (a host
with hundreds of sandboxes has fds past ``select``'s 1024) and asks a ``watch`` callback
every quarter second, so the host can kill a command that outgrows its disk limit. ``kill``
closes the pipes: the server reads the end of its input and exits, and the kernel kills every
other process of its namespace with it.

Test: ``pytest tests/unit/sandbox/test_sandbox_namespace.py -q``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from opencomposer.sandbox.bwrap import HOME, WORKDIR
from opencomposer.sandbox.execserver import recv_frame, send_frame, server_code
from opencomposer.sandbox.limits import Limiter

_WATCH_EVERY = 0.25  # seconds between looks at the workspace's size while a command runs


def server_python(env_dir: Path | None) -> str | None:
    """The interpreter of the exec server: the host's system python3 (visible through the
    read-only /usr), else the task env's, else None. It runs with ``-I -S``: stdlib only."""
    for p in ("/usr/bin/python3", "/bin/python3"):
        if os.access(p, os.X_OK):
            return p
    if env_dir is not None and os.access(os.path.join(env_dir, "bin", "python3"), os.X_OK):
        return os.path.join(os.path.abspath(env_dir), "bin", "python3")
    return None


class ExecSession:
    """The host's end of one exec server: its bwrap process and the two pipes to it."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.out = proc.stdout.fileno()  # type: ignore[union-attr]
        self.dead = False
        self.ready = False  # True once its hello has been read

    @classmethod
    def spawn(cls, prefix: list[str], python: str, limiter: Limiter, root: Path) -> ExecSession:
        """Start bwrap (``prefix``: ``bwrap.bwrap_prefix``) with the exec server as PID 1 of the
        sandbox, without waiting for its hello (the first ``recv`` does); its stderr goes to
        ``root/server.log``."""
        argv = prefix + ["--as-pid-1", "--chdir", WORKDIR, "--", python, "-I", "-S", "-c", server_code(),
                         WORKDIR, HOME, json.dumps(limiter.rlimits()), str(root)]
        with open(root / "server.log", "ab") as log:
            proc = subprocess.Popen(limiter.join(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=log, env={"PATH": "/usr/bin:/bin"}, start_new_session=True)
        return cls(proc)

    def send(self, header: dict, body: bytes = b"") -> bool:
        try:
            send_frame(self.proc.stdin.fileno(), header, body)  # type: ignore[union-attr]
            return True
        except (OSError, ValueError):
            self.dead = True
            return False

    def recv(self, wait: float | None, watch: Callable[[], str | None] | None = None) -> tuple[dict, bytes] | None:
        """The next reply within ``wait`` seconds; ``watch`` is asked every quarter second
        and a reason it gives is sent on as a ``kill`` request. None: the server is gone."""
        end = time.monotonic() + wait if wait else float("inf")
        next_watch = time.monotonic() + _WATCH_EVERY if watch else float("inf")
        try:
            while True:
                now = time.monotonic()
                if now >= end:
                    self.kill()
                    return None
                step = min(end, next_watch) - now  # None: no deadline and nothing to watch
                if self._readable(None if step == float("inf") else max(0.0, step)):
                    msg = recv_frame(self.out)
                    if msg is None:
                        self.dead = True
                    return msg
                if time.monotonic() >= next_watch:
                    reason = watch()  # type: ignore[misc]
                    if reason:
                        self.send({"op": "kill", "reason": reason})
                        watch = None
                    next_watch = time.monotonic() + _WATCH_EVERY if watch else float("inf")
        except (OSError, ValueError):
            self.dead = True
            return None

    def _readable(self, timeout: float | None) -> bool:
        # poll, not select: a host with hundreds of sandboxes has pipe fds past select's 1024
        p = select.poll()
        p.register(self.out, select.POLLIN | select.POLLHUP | select.POLLERR)
        return bool(p.poll(None if timeout is None else timeout * 1000))

    def kill(self) -> None:
        """SIGKILL bwrap and close the pipes: the server, PID 1 inside, reads the end of its
        input and exits, and the kernel kills every other process of its namespace with
        it. Not waited for: the caller reaps later (``close()`` also kills by cgroup or name)."""
        self.dead = True
        try:
            os.killpg(self.proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()  # type: ignore[union-attr]
            except OSError:
                pass

