"""A built ``opencomposer serve`` app running under uvicorn in a thread, on a free port, for tests.

    uv, thread, base = serve_in_thread(build_server(cfg))   # base: http://127.0.0.1:PORT
    ...; uv.should_exit = True; thread.join()
"""

from __future__ import annotations

import threading
import time
from typing import Any

from opencomposer.inference.server.app import uvicorn_server


def serve_in_thread(server: Any, timeout: float = 60) -> tuple[Any, threading.Thread, str]:
    """Start ``server`` (a built OpenAIServer or front door) and wait until it listens."""
    uv = uvicorn_server(server, "127.0.0.1", 0)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while not uv.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    return uv, thread, f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
