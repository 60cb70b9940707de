"""The OpenAI wire format the server speaks: request models and response builders.

Requests are pydantic models, so a bad field is an HTTP 400 naming it. Fields other
clients send and we cannot honour change the result (penalties, logit bias, a JSON
response format, a forced tool choice) are refused with a 400 naming the field rather
than silently ignored; fields that do not change the result (``user``, ``metadata``,
``parallel_tool_calls``, ...) are accepted and ignored, as OpenAI-compatible servers do.

Responses are plain dicts in the shapes of ``openai.types.chat.ChatCompletion``,
``ChatCompletionChunk`` and ``Completion``; the tests parse them with the official client.

Logprobs: ``logprobs``/``top_logprobs`` return the log-probability of each *sampled*
token and of the N most likely tokens at that position (chat: ``logprobs: true,
top_logprobs: N`` <= 20; completions: ``logprobs: N`` <= 5), as the engine computed them
(``SamplingParams.top_logprobs``; see ``inference/engine/core.py`` for the convention).

Test: ``pytest tests/unit/inference/test_server.py``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from opencomposer.protocols import POLICY_FINGERPRINT

MAX_N = 16  # choices per request; each is a separate sequence in the engine
MAX_STOP = 4  # stop strings, as OpenAI


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields ignored, as OpenAI servers do

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # an extension (vLLM has it too); 0 = off
    ignore_eos: bool = False  # an extension (vLLM's): generate to max_tokens past end-of-turn tokens
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, reason) for a setting we would otherwise silently ignore."""
        if self.presence_penalty or self.frequency_penalty:
            field = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            return field, "penalties are not supported by this server; send 0"
        if self.logit_bias:
            return "logit_bias", "not supported by this server"
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            return "stop", f"at most {MAX_STOP} stop strings, got {len(self.stop)}"
        return None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tool_choice not in (None, "auto", "none"):
            return "tool_choice", f"got {self.tool_choice!r}; only 'auto' and 'none' are supported (no constrained decoding)"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", f"type {self.response_format.get('type')!r} is not supported; only 'text'"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "needs logprobs=true"
        return super().unsupported()


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for /v1/completions
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "not supported by this server"
        return super().unsupported()


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error", code: Any = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict:
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def chat_logprobs(tokens: list[str], logprobs: list[float], tops: list[list[tuple[str, float]]] | None = None) -> dict:
    tops = tops or [[] for _ in tokens]
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())} for a, alp in top]}
                        for t, lp, top in zip(tokens, logprobs, tops)]}


def completion_logprobs(tokens: list[str], logprobs: list[float], offset: int,
                        tops: list[list[tuple[str, float]]] | None = None) -> dict:
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    top = [dict(row) for row in tops] if tops and any(tops) else None
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_completion(rid: str, model: str, choices: list[dict], usage_: dict, version: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage_, "system_fingerprint": f"{POLICY_FINGERPRINT}{version}"}


def chat_chunk(rid: str, model: str, created: int, choices: list[dict], usage_: dict | None = None,
               version: int = 0) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices,
            "system_fingerprint": f"{POLICY_FINGERPRINT}{version}"}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def text_completion(rid: str, model: str, created: int, choices: list[dict], usage_: dict | None) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body

