"""The request handlers of ``opencomposer serve``: the OpenAI routes over one engine thread.

    server = OpenAIServer(EngineLoop(engine).start(), engine.tokenizer, "smollm2-135m", engine.max_model_len)
    server.app                      # the ASGI app: POST /v1/chat/completions, /v1/completions, GET /v1/models ...

A request is checked (model name, unsupported fields), reserves its engine slots (429 with
``Retry-After`` when the server is full, before any tokenizing), becomes prompt ids and
sampling parameters, and is submitted to the ``EngineLoop``; the answer is read to the end
here, or streamed by ``streaming.py``. Errors are OpenAI error bodies (``HTTPError``; a bad
field is a 400 naming it). ``app.py`` builds the server and runs it under uvicorn.

Test: ``pytest tests/unit/inference/test_server.py tests/unit/inference/test_server_backpressure.py -q``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from opencomposer.inference.engine.loop import (
    EngineFailed,
    EngineLoop,
    Group,
    Handle,
    Overloaded,
)
from opencomposer.inference.server import schema as wire
from opencomposer.inference.server.auth import SIGNED_HEADER
from opencomposer.inference.server.chat_format import (
    ChatFormatError,
    render_chat,
    split_tool_calls,
    validate_tools,
)
from opencomposer.inference.server.streaming import (
    cached_tokens,
    stream_chat,
    stream_text,
)
from opencomposer.inference.server.text_stream import TextStream
from opencomposer.models.chat import encode_prompt

RETRY_AFTER_S = 1
CONTEXT_FULL = "context_length_exceeded"  # OpenAI's error code; the harness ends such an episode as max_tokens


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.headers, self.code = status, param, headers or {}, code


class OpenAIServer:
    """The request handlers; ``app`` is the FastAPI application serving them."""

    def __init__(self, loop: EngineLoop, tokenizer: Any, model_name: str, max_model_len: int,
                 eos_ids: frozenset[int] = frozenset(), default_max_tokens: int | None = None):
        self.loop, self.tokenizer = loop, tokenizer
        self.model_name, self.max_model_len = model_name, max_model_len
        # The engine ends a sequence on these itself; here they are only cut from the text.
        self.eos_ids, self.default_max_tokens = frozenset(eos_ids), default_max_tokens
        self.created = int(time.time())
        # set by ``front.FrontDoor``: where completions are logged, and what this engine serves
        self.recorder: Any = None
        self.signer: Any = None  # an ``auth.SessionSigner``: chat responses carry the signed session id
        self.follower: Any = None  # a ``sync.WeightFollower`` applying a trainer's versions (--weights-from)
        self.arm, self.checkpoint = "a", model_name
        self.api = self._build_app()
        self.app = self._shed_load(self.api)

    # ------------------------------------------------------------------ app and small routes

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="opencomposer", docs_url=None, redoc_url=None)
        app.exception_handler(HTTPError)(self._http_error)
        app.exception_handler(RequestValidationError)(self._validation_error)
        app.post("/v1/chat/completions")(self.chat)
        app.post("/v1/completions")(self.completions)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics)
        return app

    def _shed_load(self, app: Any) -> Any:
        """ASGI wrapper: while every slot is taken, a POST gets 429 before its body is even
        parsed, so a flood of requests costs the server as little as possible."""
        async def asgi(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["method"] == "POST" and self.loop.full():
                await self._busy(f"{self.loop.pending} sequences in flight, limit {self.loop.max_pending}")(
                    scope, receive, send)
                return
            await app(scope, receive, send)

        return asgi

    def _busy(self, why: str) -> JSONResponse:
        return JSONResponse(wire.error_body(f"server busy ({why}); retry after {RETRY_AFTER_S} s"), 429,
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    async def _http_error(self, request: Request, e: HTTPError) -> JSONResponse:
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return JSONResponse(wire.error_body(str(e), e.param, kind, e.code), e.status, headers=e.headers)

    async def _validation_error(self, request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        shown = first.get("input")
        got = f" (got {repr(shown)[:80]})" if "input" in first and not isinstance(shown, (dict, list)) else ""
        return JSONResponse(wire.error_body(f"{param or 'body'}: {first.get('msg')}{got}", param), 400)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "opencomposer", "max_model_len": self.max_model_len}]}

    async def health(self) -> JSONResponse:
        ok = self.loop.alive
        return JSONResponse({"status": "ok" if ok else "engine thread stopped", "engine_error": self.loop.error},
                            200 if ok else 503)

    async def metrics(self) -> dict:
        stats = await self.loop.call(self.loop.engine.stats)
        out = {"engine": stats, "server": {**self.loop.counters, "pending": self.loop.pending,
                                           "max_pending": self.loop.max_pending}}
        if self.follower is not None:
            out["weights_sync"] = self.follower.stats()
        return out

    # ------------------------------------------------------------------ shared request steps

    def _check(self, req: wire._Request) -> None:
        if req.model != self.model_name:
            raise HTTPError(404, f"model {req.model!r} not found; this server serves {self.model_name!r}", "model")
        bad = req.unsupported()
        if bad:
            raise HTTPError(400, f"{bad[0]}: {bad[1]}", bad[0])

    def _reserve(self, n: int) -> None:
        if n > self.loop.max_pending:
            raise HTTPError(400, f"n: {n} sequences in one request exceed this server's limit of "
                            f"{self.loop.max_pending}", "n")
        try:
            self.loop.reserve(n)
        except Overloaded as e:
            raise HTTPError(429, f"server busy ({e}); retry after {RETRY_AFTER_S} s", None,
                            {"Retry-After": str(RETRY_AFTER_S)}) from None

    def _params(self, req: wire._Request, prompt_len: int, seq: int, explicit: int | None, default: int | None):
        from opencomposer.inference.engine.core import SamplingParams

        room = self.max_model_len - prompt_len
        if explicit is not None and explicit > room:
            raise HTTPError(400, f"the prompt is {prompt_len} tokens and max_tokens is {explicit}: together "
                            f"{prompt_len + explicit}, more than the model's context of {self.max_model_len} tokens",
                            "max_tokens", code=CONTEXT_FULL)
        if room < 1:
            raise HTTPError(400, f"the prompt is {prompt_len} tokens, which leaves no room to generate in the "
                            f"model's context of {self.max_model_len} tokens", "messages", code=CONTEXT_FULL)
        max_tokens = explicit if explicit is not None else min(default or room, room)
        return SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            stop=req.stop_strings(), ignore_eos=req.ignore_eos,
            seed=None if req.seed is None else req.seed + seq,
            top_logprobs=(req.top_logprobs or 0) if isinstance(req, wire.ChatRequest) and req.logprobs
            else (req.logprobs or 0) if isinstance(req, wire.CompletionRequest) else 0,
        )

    @contextmanager
    def _reserved(self, n: int) -> Iterator[None]:
        """Hold ``n`` engine slots while the request is prepared; a busy server answers 429
        here, before any tokenizing. Released again if preparing fails."""
        self._reserve(n)
        try:
            yield
        except BaseException:
            self.loop.release(n)
            raise

    async def _abort(self, group: Group) -> None:
        """After a streamed response (finished or cut off): abort what is still running.
        A coroutine, so Starlette runs it on the event loop rather than in a worker thread."""
        self.loop.abort(group)

    async def _collect(self, group: Group, streams: list[TextStream], request: Request) -> None:
        """Read a group to the end (non-streaming); abort it if the client goes away."""
        async def read() -> None:
            async for i, out in group:
                streams[i].add(out.new_token_ids, out.new_logprobs, out.new_top_logprobs)

        task = asyncio.ensure_future(read())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.1)
                if done:
                    task.result()
                    return
                if await request.is_disconnected():
                    task.cancel()
                    return
        except EngineFailed as e:
            raise HTTPError(500, f"the engine failed: {e}") from None
        except ValueError as e:  # the engine refused the request (its limits; ours are checked first)
            raise HTTPError(400, str(e)) from None
        finally:
            self.loop.abort(group)  # a no-op for finished sequences

    # ------------------------------------------------------------------ chat completions

    async def chat(self, req: wire.ChatRequest, request: Request):
        t0 = time.perf_counter()
        self._check(req)
        explicit = req.max_completion_tokens or req.max_tokens
        with self._reserved(req.n):
            try:
                tools = validate_tools(req.tools) if req.tool_choice != "none" else []
                prompt = render_chat(self.tokenizer, req.messages, tools)
            except ChatFormatError as e:
                raise HTTPError(400, str(e), e.param) from None
            ids = encode_prompt(self.tokenizer, prompt)
            seqs = [(ids, self._params(req, len(ids), j, explicit, self.default_max_tokens)) for j in range(req.n)]
            rid, headers = wire.new_id("chatcmpl"), self._session_headers(request, req)
        group = self.loop.submit(seqs)
        streams = [TextStream(self.tokenizer, req.stop_strings()) for _ in range(req.n)]
        if req.stream:
            body = stream_chat(self, req, group, streams, bool(tools), len(ids),
                                     (rid, request.headers, ids, tools, t0))
            return StreamingResponse(body, media_type="text/event-stream", headers=headers,
                                     background=BackgroundTask(self._abort, group))
        await self._collect(group, streams, request)
        choices = [self._chat_choice(h, s, bool(tools), req.logprobs) for h, s in zip(group.handles, streams)]
        self.record(rid, req, request.headers, ids, tools, group, streams, t0, stream=False)
        completion = sum(len(s.token_ids) for s in streams)
        usage = wire.usage(len(ids), completion, cached_tokens(group.handles[:1]))  # the prompt counts once
        # the newest weights any returned token came from (they change in flight: sync, hot-swap)
        version = max((h.completion.policy_versions[-1] for h in group.handles  # versions only grow in a sequence
                       if h.completion and h.completion.policy_versions), default=self.loop.engine.policy_version)
        return JSONResponse(wire.chat_completion(rid, self.model_name, choices, usage, version), headers=headers)

    def _session_headers(self, request: Request, req: wire.ChatRequest) -> dict[str, str]:
        """``X-Signed-Session-Id`` when the request names a session: what its feedback must send
        (``auth.py``). Only printable ASCII ids can go in a header; others get none."""
        from opencomposer.inference.server.session_log import session_id

        sid = session_id(request.headers, req.model_extra) if self.signer is not None else None
        return {SIGNED_HEADER: self.signer.sign(sid)} if sid and sid.isascii() and sid.isprintable() else {}

    def final_text(self, h: Handle, s: TextStream) -> str:
        """The finished sequence's text: the engine's own ``Completion.text`` when it has one."""
        return h.completion.text if h.completion is not None else s.final_text(self.eos_ids)

    def _chat_choice(self, h: Handle, s: TextStream, tools: bool, logprobs: bool) -> dict:
        i, finish, text = h.index, h.finish_reason, self.final_text(h, s)
        content, calls = split_tool_calls(text) if tools else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls" if finish == "stop" else finish
        lp = wire.chat_logprobs(s.token_strings(), s.logprobs, s.top_strings()) if logprobs else None
        return {"index": i, "message": message, "finish_reason": finish, "logprobs": lp}

    def record(self, rid: str, req: wire.ChatRequest, headers: Any, ids: list[int], tools: list, group: Group,
                streams: list[TextStream], t0: float, stream: bool) -> None:
        """Log each finished choice (``--log-dir``): what the trainer needs to learn from it."""
        if self.recorder is None:
            return
        from opencomposer.inference.server.session_log import (
            completion_record,
            session_id,
        )

        # the record's id is the response's id + ":" + choice index: what a feedback event's completion_id names
        sid, latency = session_id(headers, req.model_extra), time.perf_counter() - t0
        for h, s in zip(group.handles, streams):
            c = h.completion
            if c is None:  # aborted: nothing the user saw in full
                continue
            text = self.final_text(h, s)
            content, calls = split_tool_calls(text) if tools else (text, [])
            self.recorder(completion_record(
                rid=rid, index=h.index, sid=sid, arm=self.arm, checkpoint=self.checkpoint, model=self.model_name,
                messages=req.messages, tools=req.tools, temperature=req.temperature, top_p=req.top_p,
                prompt_ids=ids, token_ids=list(c.token_ids), logprobs=list(c.logprobs),
                policy_versions=list(c.policy_versions), text=content, tool_calls=calls,
                finish_reason=h.finish_reason, latency_s=latency, stream=stream))

    # ------------------------------------------------------------------ text completions

    async def completions(self, req: wire.CompletionRequest, request: Request):
        self._check(req)
        p = req.prompt
        count = 1 if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)) else len(p)
        with self._reserved(max(count, 1) * req.n):
            prompts = self._prompt_ids(p)
            seqs = [(ids, self._params(req, len(ids), k * req.n + j, req.max_tokens, None))
                    for k, ids in enumerate(prompts) for j in range(req.n)]
        group = self.loop.submit(seqs)
        streams = [TextStream(self.tokenizer, req.stop_strings()) for _ in range(len(prompts) * req.n)]
        prompt_tokens = sum(len(p) for p in prompts) * req.n
        if req.stream:
            return StreamingResponse(stream_text(self, req, group, streams, prompts, prompt_tokens),
                                     media_type="text/event-stream", background=BackgroundTask(self._abort, group))
        await self._collect(group, streams, request)
        choices = []
        for i, (h, s) in enumerate(zip(group.handles, streams)):
            head = self.echo(req, prompts[i // req.n])
            lp = (wire.completion_logprobs(s.token_strings(), s.logprobs, len(head), s.top_strings())
                  if req.logprobs is not None else None)
            choice = {"index": i, "text": head + self.final_text(h, s), "finish_reason": h.finish_reason, "logprobs": lp}
            if req.model_extra.get("return_token_ids") and h.completion is not None:
                c = h.completion  # what a trainer needs of the sample, exactly (``inference.remote_policy``)
                choice["opencomposer"] = {"token_ids": list(c.token_ids), "logprobs": list(c.logprobs),
                                          "policy_versions": list(c.policy_versions)}
            choices.append(choice)
        usage = wire.usage(prompt_tokens, sum(len(s.token_ids) for s in streams), cached_tokens(group.handles))
        return wire.text_completion(wire.new_id("cmpl"), self.model_name, int(time.time()), choices, usage)

    def _prompt_ids(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise HTTPError(400, "prompt: must not be empty", "prompt")
        if all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        out = []
        for i, p in enumerate(prompt):
            ids = encode_prompt(self.tokenizer, p) if isinstance(p, str) else list(p)
            vocab = len(self.tokenizer)
            if not ids or any(not 0 <= t < vocab for t in ids):
                raise HTTPError(400, f"prompt[{i}]: empty, or token ids outside the vocabulary [0, {vocab})", "prompt")
            out.append(ids)
        return out

    def echo(self, req: wire.CompletionRequest, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if req.echo else ""
