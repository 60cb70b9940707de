"""``opencomposer serve`` in a child process, for scripts and tests that need a live server.

    with serve_process("--model", "tiny-random", "--port", "0") as ready:
        url = ready["serving"]          # e.g. http://127.0.0.1:41237/v1

The server prints one JSON ready line once its socket listens; this waits for that line,
yields it, and stops the server with SIGINT (its clean shutdown) on exit. ``env`` is the
child's environment (e.g. ``OPENCOMPOSER_SERVE_TOKEN``, so the token is not in argv);
``stderr`` an open file for what it prints there (default: kept only to explain a failed start).

Test: ``pytest tests/integration/test_serve_auth.py tests/integration/test_realtime_cycle.py``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO


class ServeStartError(RuntimeError):
    """The server exited before it printed its ready line; the message ends with its stderr."""


@contextmanager
def serve_process(*args: str, stop_timeout: float = 30.0, env: dict[str, str] | None = None,
                  stderr: IO[str] | None = None) -> Iterator[dict]:
    proc = subprocess.Popen([sys.executable, "-m", "opencomposer.cli", "serve", *args], env=env,
                            stdout=subprocess.PIPE, stderr=stderr or subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "" if it died before listening
        if not line:
            proc.kill()
            why = proc.stderr.read()[-2000:] if stderr is None else f"see {getattr(stderr, 'name', 'its stderr')}"
            raise ServeStartError(f"opencomposer serve did not start: {why}")
        yield json.loads(line)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
