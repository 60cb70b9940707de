"""``opencomposer serve`` inside a long-lived process that is not its own, e.g. a Ray actor
(``rl/cluster.py`` makes one per rollout engine): the server runs in a thread of that process,
on a free port of the address given.

    host = ServeHost(ServeConfig(model="tiny-random", weights_from="s3://b/run", device="cpu"), bind="10.0.0.5")
    host.url()      # "http://10.0.0.5:41237/v1"
    host.info()     # pid, host name, device, weights version, the GPUs the process may see
    host.stop()

The server is the one ``opencomposer serve`` runs (``front.build_front``: the engine thread, the
weight follower of ``weights_from``, the same endpoints and auth: without an ``api_token``,
``/admin/*`` answers loopback clients only). A start that fails raises here, with its cause;
``start_timeout_s`` bounds the wait for the socket.

Test: ``pytest tests/unit/inference/test_serve_host.py tests/integration/test_ray_rl.py``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from opencomposer.inference.server.app import ServeConfig, uvicorn_server
from opencomposer.inference.server.front import build_front


class ServeHost:
    def __init__(self, cfg: ServeConfig, bind: str = "127.0.0.1", start_timeout_s: float = 60.0):
        self.cfg, self.bind = cfg, bind
        self.front = build_front(cfg)  # loads the model, starts the engine thread and the follower
        self._uv = uvicorn_server(self.front, bind, 0)
        self._thread = threading.Thread(target=self._uv.run, name="serve-host", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._uv.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"serve --model {cfg.model} on {bind}: the HTTP server did not start within "
                                   f"{start_timeout_s:g} s")
            time.sleep(0.02)
        self.port = int(self._uv.servers[0].sockets[0].getsockname()[1])

    def url(self) -> str:
        """The OpenAI-compatible base URL (``.../v1``) clients on other nodes reach it at."""
        return f"http://{self.bind}:{self.port}/v1"

    def info(self) -> dict[str, Any]:
        """Where it runs and what it holds (the weights version the follower last applied)."""
        arm = self.front.arms["a"]
        engine = arm.loop.engine
        return {"url": self.url(), "pid": os.getpid(), "host": socket.gethostname(), "model": self.cfg.model,
                "device": str(getattr(engine, "device", self.cfg.device)), "dtype": self.cfg.dtype,
                "version": getattr(engine, "policy_version", None),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "engine_error": arm.loop.error}

    def stop(self) -> None:
        """Stop the HTTP server, then the engine thread and the follower."""
        self._uv.should_exit = True
        if self._thread.is_alive():
            self._thread.join(10)
        self.front.stop()
