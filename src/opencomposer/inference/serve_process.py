"""``opencomposer serve`` in a child process, for scripts and tests that need a live server.

    with serve_process("--model", "tiny-random", "--port", "0") as ready:
        url = ready["serving"]          # e.g. http://127.0.0.1:41237/v1

The server prints one JSON ready line once its socket listens; this waits for that line,
yields it, and stops the server with SIGINT (its clean shutdown) on exit.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


class ServeStartError(RuntimeError):
    """The server exited before it printed its ready line; the message ends with its stderr."""


@contextmanager
def serve_process(*args: str, stop_timeout: float = 30.0) -> Iterator[dict]:
    proc = subprocess.Popen([sys.executable, "-m", "opencomposer.cli", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "" if it died before listening
        if not line:
            proc.kill()
            raise ServeStartError(f"opencomposer serve did not start: {proc.stderr.read()[-2000:]}")
        yield json.loads(line)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
