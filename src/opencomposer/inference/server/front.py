"""The front door of ``opencomposer serve``: session logs, feedback, A/B arms, weight hot-swap.

    opencomposer serve --model smollm2-135m --log-dir runs/serve-logs \\
        [--ab-model runs/realtime/candidates/cycle-0003 --ab-fraction 0.2]   # token: OPENCOMPOSER_SERVE_TOKEN

An ASGI app in front of one ``OpenAIServer`` per arm (each with its own engine thread):

* Sessions: a request belongs to the session named by its ``X-Session-Id`` header or, if
  absent, its ``user`` field. Sessions are split between arm ``a`` (``--model``) and arm
  ``b`` (``--ab-model``) deterministically: arm b iff ``sha256(session id) / 2**256 <
  ab_fraction``, so every turn of a session goes to the same weights. Requests without a
  session go to arm a.
* Logging (``--log-dir``): every chat completion, with its arm, checkpoint and weights
  version, goes to ``session_log.SessionLog`` (see that module for the record).
* ``POST /v1/feedback``: ``{"session_id", "kind": "edit_kept" | "edit_reverted" |
  "follow_up", "completion_id"?, "diff"?, "text"?}``; a follow-up needs ``text``. The
  ``session_id`` is the signed one the session's chat responses carried in
  ``X-Signed-Session-Id`` (``auth.py``; anything else is a 403), ``completion_id`` a
  response's ``id`` + ``":"`` + choice index. Logged as a ``feedback`` record under the
  plain session id; a bad event is a 400 naming the field. Whether a follow-up is
  dissatisfied is decided later by the real-time loop's classifier, so a better classifier
  can re-score old logs.
* ``--weights-from STORE`` (``sync/``): arm a follows a trainer's weight store, applying
  each new version in flight; ``/metrics`` and ``/admin/arms`` show where it is.
* ``POST /admin/weights`` ``{"path": HF model dir, "arm": "a", "version"?}``: loads the
  directory's safetensors and applies them with ``Engine.update_weights`` between two
  engine steps (running sequences continue; the prefix cache is dropped). ``GET
  /admin/arms``: each arm's checkpoint, weights version, share of sessions and queue.
* Credentials (``auth.py``): with ``--api-token`` / ``OPENCOMPOSER_SERVE_TOKEN`` set,
  ``/admin/*`` and ``/v1/feedback`` need ``Authorization: Bearer <token>`` (else 401);
  without one, ``/admin/*`` takes loopback clients only and ``serve`` warns at start.

Everything else (``/v1/models``, ``/health``, ``/metrics``) is answered by arm a.

Test: ``pytest tests/unit/inference/test_front.py tests/integration/test_serve_auth.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from opencomposer.inference.server import schema as wire
from opencomposer.inference.server.app import ServeConfig, build_server, uvicorn_server
from opencomposer.inference.server.auth import (
    Refused,
    SessionSigner,
    changes_state,
    check_bearer,
    open_warning,
)
from opencomposer.inference.server.handlers import OpenAIServer
from opencomposer.inference.server.session_log import SessionLog

ROUTED = ("/v1/chat/completions", "/v1/completions")


class FeedbackEvent(BaseModel):
    """What a client reports after a completion: the edit kept or reverted, or a follow-up."""

    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(..., min_length=1, max_length=512)  # signed: "<session id>.<signature>"
    kind: Literal["edit_kept", "edit_reverted", "follow_up"]
    completion_id: str | None = Field(None, max_length=256)
    diff: str | None = Field(None, max_length=1_000_000)
    text: str | None = Field(None, max_length=100_000)

    @model_validator(mode="after")
    def _follow_up_has_text(self) -> FeedbackEvent:
        if self.kind == "follow_up" and not (self.text or "").strip():
            raise ValueError("text: a follow_up event needs the user's message in 'text'")
        return self


class WeightsUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(..., min_length=1)
    arm: str = "a"
    version: int | None = Field(None, ge=0)


def arm_for(session: str | None, fraction: float) -> str:
    """``"b"`` for the ``fraction`` of session ids whose hash falls below it, else ``"a"``."""
    if session is None or fraction <= 0:
        return "a"
    h = int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big") / 2**64
    return "b" if h < fraction else "a"


def load_weights_dir(path: str | Path) -> dict[str, Any]:
    """HF-named tensors from every ``*.safetensors`` file of a model directory."""
    from safetensors.torch import load_file

    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        raise ValueError(f"path: {root} holds no *.safetensors files (expected an HF model directory, "
                         f"e.g. a realtime candidate or train.export.export_model output)")
    sd: dict[str, Any] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd


class FrontDoor:
    """Routes requests to arms, logs sessions, takes feedback and weight updates."""

    def __init__(self, arms: dict[str, OpenAIServer], fraction: float = 0.0, log: SessionLog | None = None,
                 api_token: str | None = None, signer: SessionSigner | None = None):
        if "a" not in arms:
            raise ValueError("FrontDoor needs an arm 'a'")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"ab_fraction must be in [0, 1], got {fraction}")
        self.arms, self.fraction, self.log, self.api_token = arms, fraction if "b" in arms else 0.0, log, api_token
        self.signer = signer or SessionSigner()  # one secret for both arms: a session may be answered by either
        for name, s in arms.items():
            s.arm, s.signer = name, self.signer
            s.recorder = log.write if log is not None else None
        self.feedback_count = 0
        self.api = self._build_app()

        async def app(scope: dict, receive: Any, send: Any) -> None:  # a plain function: uvicorn sniffs ASGI 3
            await self._route(scope, receive, send)

        self.app = app

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="opencomposer-front", docs_url=None, redoc_url=None)
        app.exception_handler(RequestValidationError)(self._validation_error)
        app.post("/v1/feedback")(self.feedback)
        app.post("/admin/weights")(self.swap_weights)
        app.get("/admin/arms")(self.arms_info)
        return app

    async def _route(self, scope: dict, receive: Any, send: Any) -> None:
        """The ASGI entry point (``self.app``)."""
        if scope["type"] != "http":
            await self.arms["a"].app(scope, receive, send)
            return
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if changes_state(path):
            try:  # before the body is read: a caller without the token learns nothing else
                check_bearer(path, headers, (scope.get("client") or ("",))[0], self.api_token)
            except Refused as e:
                await _refusal(e)(scope, receive, send)
                return
            await self.api(scope, receive, send)
            return
        if path not in ROUTED or len(self.arms) == 1:
            await self.arms["a"].app(scope, receive, send)
            return
        sid = headers.get("x-session-id")
        if not sid:  # the session may be in the body's ``user`` field: read it, then replay it
            body, receive = await _buffer(receive)
            try:
                user = json.loads(body).get("user") if body else None
            except (ValueError, AttributeError):
                user = None  # the arm answers the bad body with its own 400
            sid = user if isinstance(user, str) else None
        await self.arms[arm_for(sid, self.fraction)].app(scope, receive, send)

    # ------------------------------------------------------------------ routes

    async def _validation_error(self, request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        msg = str(first.get("msg", ""))
        param = ".".join(loc) or (msg.split("Value error, ", 1)[-1].split(":", 1)[0] if ":" in msg else None)
        return JSONResponse(wire.error_body(f"{'.'.join(loc) or 'body'}: {msg}", param), 400)

    async def feedback(self, event: FeedbackEvent):
        if self.log is None:
            return JSONResponse(wire.error_body("feedback is not recorded: start the server with --log-dir DIR"), 409)
        try:
            sid = self.signer.verify(event.session_id)
        except Refused as e:
            return _refusal(e, "session_id")
        self.log.write({"type": "feedback", **event.model_dump(), "session_id": sid})
        self.feedback_count += 1
        return {"ok": True, "session_id": sid, "arm": arm_for(sid, self.fraction)}

    async def swap_weights(self, update: WeightsUpdate):
        server = self.arms.get(update.arm)
        if server is None:
            return JSONResponse(wire.error_body(f"arm: {update.arm!r} is not served; arms: {sorted(self.arms)}",
                                                "arm"), 400)
        t0 = time.perf_counter()
        engine = server.loop.engine
        version = update.version if update.version is not None else engine.policy_version + 1
        try:
            sd = await asyncio.to_thread(load_weights_dir, update.path)
            await asyncio.to_thread(engine.update_weights, sd, version)
        except (ValueError, KeyError, RuntimeError, OSError) as e:
            return JSONResponse(wire.error_body(f"path: cannot load weights from {update.path}: {e}", "path"), 400)
        server.checkpoint = update.path
        return {"arm": update.arm, "checkpoint": update.path, "policy_version": version,
                "seconds": round(time.perf_counter() - t0, 3)}

    async def arms_info(self):
        return {"fraction_b": self.fraction, "feedback_events": self.feedback_count,
                "logged": self.log.records if self.log else None,
                "arms": {name: {"checkpoint": s.checkpoint, "policy_version": s.loop.engine.policy_version,
                                "pending": s.loop.pending, **{k: v for k, v in s.loop.counters.items()},
                                "weights_sync": s.follower.stats() if s.follower is not None else None}
                         for name, s in self.arms.items()}}

    def stop(self) -> None:
        for s in self.arms.values():
            if s.follower is not None:
                s.follower.stop()
            s.loop.stop()
        if self.log is not None:
            self.log.close()


def _refusal(e: Refused, param: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(wire.error_body(str(e), param, code=e.code), e.status, headers=headers)


async def _buffer(receive: Any) -> tuple[bytes, Any]:
    """Read the whole request body; return it and a ``receive`` that replays it."""
    chunks, more = [], True
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            return b"", receive  # disconnected
        chunks.append(msg.get("body", b""))
        more = msg.get("more_body", False)
    body, sent = b"".join(chunks), False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


def build_front(cfg: ServeConfig) -> FrontDoor:
    """Arm a from ``cfg.model``, arm b from ``cfg.ab_model`` (same served name), the log."""
    arms = {"a": build_server(cfg)}
    if cfg.ab_model:
        # arm b is a fixed candidate: only arm a follows a trainer's weights
        arms["b"] = build_server(replace(cfg, model=cfg.ab_model, served_model_name=arms["a"].model_name,
                                         weights_from=None))
        arms["b"].checkpoint = cfg.ab_model
    log = SessionLog(cfg.log_dir, cfg.log_window_s) if cfg.log_dir else None
    return FrontDoor(arms, cfg.ab_fraction, log, cfg.api_token)


def serve(cfg: ServeConfig, on_ready=None) -> None:
    """Run until interrupted. ``on_ready(url)`` is called once the socket listens
    (port 0 picks a free port; the url has the real one). Without ``cfg.api_token``, a
    warning on stderr says who can reach the endpoints that change state."""
    server = build_front(cfg)
    uv = uvicorn_server(server, cfg.host, cfg.port)

    async def main() -> None:
        task = asyncio.create_task(uv.serve())
        while not uv.started and not task.done():
            await asyncio.sleep(0.05)
        if uv.started:
            port = uv.servers[0].sockets[0].getsockname()[1]  # the real one when cfg.port is 0
            warning = open_warning(cfg.api_token, cfg.host, port)
            if warning:
                print(warning, file=sys.stderr, flush=True)
            if on_ready is not None:
                on_ready(f"http://{cfg.host}:{port}/v1")
        await task

    try:
        asyncio.run(main())
    finally:
        server.stop()
