"""Talk to the running ``opencomposer serve``: its arms, and hot-swapping a checkpoint in.

    server = ServerClient("http://127.0.0.1:8000", token=None)
    server.arms()                                       # GET /admin/arms
    server.swap("runs/rt/candidates/cycle-0003", arm="a", version=12)   # POST /admin/weights

The swap is the engine's in-flight weight update (``Engine.update_weights``, between two
engine steps): running sessions continue on the new weights, nothing restarts. Any
connection failure is a ``ServerUnreachable`` naming the URL.

Test: ``pytest tests/unit/inference/test_front.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx


class ServerUnreachable(RuntimeError):
    """No answer from the server's URL (not started, wrong port, crashed)."""


class ServerRefused(RuntimeError):
    """The server answered with an error (bad path, wrong token, unknown arm)."""


class ServerClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 300.0):
        self.base = url.rstrip("/").removesuffix("/v1")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = timeout

    def _call(self, method: str, path: str, **kw: Any) -> dict:
        url = self.base + path
        try:
            r = httpx.request(method, url, headers=self.headers, timeout=self.timeout, **kw)
        except httpx.HTTPError as e:
            raise ServerUnreachable(f"server unreachable at {url}: {type(e).__name__}: {e} "
                                    f"(is `opencomposer serve` running there?)") from None
        if r.status_code != 200:
            try:
                msg = r.json()["error"]["message"]
            except Exception:
                msg = r.text[:300]
            raise ServerRefused(f"{method} {url}: HTTP {r.status_code}: {msg}")
        return r.json()

    def arms(self) -> dict:
        return self._call("GET", "/admin/arms")

    def swap(self, path: str | Path, arm: str = "a", version: int | None = None) -> dict:
        body: dict[str, Any] = {"path": str(Path(path).resolve()), "arm": arm}
        if version is not None:
            body["version"] = version
        return self._call("POST", "/admin/weights", json=body)

    def feedback(self, event: dict) -> dict:
        return self._call("POST", "/v1/feedback", json=event)
