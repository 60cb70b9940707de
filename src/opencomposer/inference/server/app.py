"""``opencomposer serve``: an OpenAI-compatible HTTP server over the built-in engine.

    opencomposer serve --model smollm2-135m --port 8000
    opencomposer agent --task tasks/<id> --policy openai --base-url http://127.0.0.1:8000/v1 --model smollm2-135m

Endpoints: ``POST /v1/chat/completions`` (tools, streaming, ``n``, logprobs),
``POST /v1/completions``, ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (JSON:
engine stats and request counters). ``serve()`` puts ``front.FrontDoor`` in front of it:
``--log-dir`` session logs, ``POST /v1/feedback``, A/B arms, ``/admin/weights`` hot-swap;
``auth.py`` says who may call ``/v1/feedback`` and ``/admin/*`` (a bearer token; signed
session ids: a chat response naming a session carries ``X-Signed-Session-Id``).

How a chat request becomes tokens: the messages and tools go through
``chat_format.render_chat``, i.e. the same ``models.chat.render_prompt`` that training
uses, so a conversation served here and the same conversation recomputed by the trainer
are the same prompt, byte for byte. The output's ``<tool_call>`` blocks are parsed with the
harness codec into ``message.tool_calls`` (``finish_reason: "tool_calls"``).

Threads: FastAPI/uvicorn handle HTTP on one asyncio loop; one ``EngineLoop`` thread owns
the engine (``Engine.step`` is not thread-safe). Back-pressure: at most ``max_pending``
sequences in flight; beyond that a request gets 429 with ``Retry-After`` at once. A client
that disconnects has its sequences aborted, which frees their KV blocks.

Why FastAPI + uvicorn: the request bodies are pydantic models (already a dependency), so
a bad field becomes a 400 naming it for free, and Starlette's streaming response notices
a client disconnect, which is what lets us abort the sequence.

The modules: ``app.py`` (this one) the process: ``ServeConfig``, ``build_server`` (model, engine
thread, weight follower), ``uvicorn_server``; ``front.py`` adds the real-time loop's endpoints and ``serve`` (uvicorn until
interrupted); ``handlers.py`` the routes
(``OpenAIServer``); ``streaming.py`` the server-sent events of ``stream: true``.

Test: ``pytest tests/unit/inference/test_server.py tests/integration/test_serve_harness.py``
(credentials: ``tests/integration/test_serve_auth.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opencomposer.inference.engine.loop import EngineLoop
from opencomposer.inference.server.handlers import OpenAIServer


@dataclass
class ServeConfig:
    model: str = "smollm2-135m"
    served_model_name: str | None = None  # the name clients send as ``model``; default: ``model``
    host: str = "127.0.0.1"
    port: int = 8000
    max_num_seqs: int = 64  # sequences the engine runs at once
    max_pending: int = 256  # sequences admitted (running + waiting) before requests get 429
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    default_max_tokens: int | None = None  # when a chat request gives none: this, capped by the room left
    dtype: str = "float32"
    device: str | None = None
    kv_blocks: int | None = None
    kv_memory_fraction: float = 0.8  # of free GPU memory for the KV cache, when kv_blocks is not given
    max_num_batched_tokens: int | None = None  # new tokens per prefill step (default: the engine's)
    # real-time loop (``inference/server/front.py``): session logs, A/B arm, admin hot-swap
    log_dir: str | None = None  # every chat completion and feedback event, JSONL (``session_log.py``)
    log_window_s: float = 3600.0  # one log file per window
    ab_model: str | None = None  # arm "b": a second checkpoint; sessions split by id
    ab_fraction: float = 0.5  # share of sessions routed to arm "b"
    # /admin/* and /v1/feedback need "Authorization: Bearer TOKEN" (none: admin from loopback only; ``auth.py``)
    api_token: str | None = None
    # weight sync (``sync/``): follow a trainer's store, applying each new version in flight
    weights_from: str | None = None  # a directory, file:///path or s3://bucket/prefix
    weights_poll_s: float = 1.0
    # speculative decoding (``speculate.py``): an MTP head directory (``opencomposer train-mtp``)
    draft: str | None = None
    num_draft: int = 3
    spec_max_batch: int = 1  # larger decode batches step plainly (measured: speculation pays at batch 1)


def build_server(cfg: ServeConfig) -> OpenAIServer:
    """Load the model, start the engine thread, and return the server (not yet listening)."""
    import torch

    from opencomposer.config import ConfigError
    from opencomposer.inference.engine.core import Engine

    dtype = getattr(torch, cfg.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"--dtype {cfg.dtype!r}: expected float32, bfloat16 or float16")
    try:
        engine = Engine.from_name(cfg.model, max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
                                  kv_blocks=cfg.kv_blocks, kv_memory_fraction=cfg.kv_memory_fraction,
                                  max_num_batched_tokens=cfg.max_num_batched_tokens, device=cfg.device, dtype=dtype,
                                  draft=cfg.draft, num_draft=cfg.num_draft, spec_max_batch=cfg.spec_max_batch)
    except ValueError as e:  # limits the engine cannot meet, e.g. a context longer than the model's
        draft = f" --draft {cfg.draft}" if cfg.draft else ""
        raise ConfigError(f"serve --model {cfg.model}{draft}: {e}") from None
    follower = None
    if cfg.weights_from:
        from opencomposer.sync.store import StoreError, open_store
        from opencomposer.sync.subscriber import WeightFollower, WeightSubscriber
        try:
            store = open_store(cfg.weights_from)
        except StoreError as e:
            raise ConfigError(f"--weights-from: {e}") from None
        follower = WeightFollower(WeightSubscriber(store), engine, cfg.weights_poll_s)
    loop = EngineLoop(engine, max_pending=cfg.max_pending).start()
    server = OpenAIServer(loop, engine.tokenizer, cfg.served_model_name or cfg.model, engine.max_model_len,
                          engine.eos_ids, cfg.default_max_tokens)
    if follower is not None:
        server.follower = follower.start()
    return server


def uvicorn_server(server: OpenAIServer, host: str, port: int, **kw: Any):
    import uvicorn

    config = uvicorn.Config(server.app, host=host, port=port, log_level="warning", access_log=False,
                            backlog=4096, timeout_graceful_shutdown=5, **kw)
    return uvicorn.Server(config)
