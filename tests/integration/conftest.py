"""Helpers of the integration tests: tiny sdists, the CLI in a subprocess, a server that follows
a weight store. The toolz tasks (``toolz_tasks``) and ``write_cfg`` are shared with
tests/distributed: tests/testkit/rl_tasks.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import subprocess
from pathlib import Path

import pytest

from opencomposer.sandbox.namespace import unavailable_reason

NS_REASON = unavailable_reason()
BACKENDS = ["local", pytest.param("namespace", marks=pytest.mark.skipif(bool(NS_REASON), reason=str(NS_REASON)))]


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    import sys
    return subprocess.run([sys.executable, "-m", "opencomposer.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)


@contextlib.contextmanager
def following_server(store: Path) -> Iterator[tuple[Any, str]]:
    """``opencomposer serve --weights-from STORE`` of tiny-random, in a thread of this process:
    yields (the front, its /v1 URL); stopped on exit."""
    import threading
    import time

    from opencomposer.inference.server.front import build_front
    from opencomposer.inference.server.app import ServeConfig, uvicorn_server

    front = build_front(ServeConfig(model="tiny-random", max_num_seqs=8, weights_from=str(store), weights_poll_s=0.05))
    uv = uvicorn_server(front, "127.0.0.1", 0)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        while not uv.started:
            assert thread.is_alive(), "server did not start"
            time.sleep(0.02)
        yield front, f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}/v1"
    finally:
        uv.should_exit = True
        thread.join(10)
        front.stop()
