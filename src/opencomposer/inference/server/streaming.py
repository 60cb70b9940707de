"""Server-sent events of ``opencomposer serve``: a chat or text completion streamed as it decodes.

    return StreamingResponse(stream_chat(server, req, group, streams, ...), media_type="text/event-stream")

Each engine output becomes a ``data: {...}`` chunk in OpenAI's format; the stream ends with
``data: [DONE]``, or with an error chunk when the engine fails mid-stream. Text is held back
where a stop string or a ``<tool_call>`` block may still begin (``text_stream.TextStream``);
a chat stream sends a finished sequence's tool calls as one ``tool_calls`` delta. Whatever
way the stream ends, the sequences still running are aborted (their KV blocks freed).
The request handlers that start these streams are in ``handlers.py``.

Test: ``pytest tests/unit/inference/test_server.py -q`` (the ``stream`` cases).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from opencomposer.inference.engine.loop import EngineFailed, Group, Handle
from opencomposer.inference.server import schema as wire
from opencomposer.inference.server.chat_format import (
    content_before_tool_call,
    split_tool_calls,
)
from opencomposer.inference.server.text_stream import TextStream
from opencomposer.models import codec

if TYPE_CHECKING:
    from opencomposer.inference.server.handlers import OpenAIServer


async def stream_chat(server: OpenAIServer, req: wire.ChatRequest, group: Group, streams: list[TextStream],
                       tools: bool, prompt_len: int, log_args: tuple) -> AsyncIterator[str]:
    rid, created = log_args[0], int(time.time())

    def chunk(i: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> str:
        c = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return sse(wire.chat_chunk(rid, server.model_name, created, [c], version=server.loop.engine.policy_version))

    sent = [""] * len(streams)
    try:
        for i in range(len(streams)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for i, out in group:
            s = streams[i]
            first = len(s.token_ids)
            s.add(out.new_token_ids, out.new_logprobs, out.new_top_logprobs)
            lp = (wire.chat_logprobs(s.token_strings(first), out.new_logprobs, s.top_strings(first))
                  if req.logprobs else None)
            if not out.finished:
                shown = content_before_tool_call(s.visible()) if tools else s.visible()
                if shown[len(sent[i]):] or lp:
                    yield chunk(i, {"content": shown[len(sent[i]):]}, None, lp)
                    sent[i] = shown
                continue
            text = server.final_text(group.handles[i], s)
            calls = split_tool_calls(text)[1] if tools else []
            rest = (text[: text.find(codec.OPEN)] if calls else text)[len(sent[i]):]
            if rest or lp:
                yield chunk(i, {"content": rest}, None, lp)
            if calls:
                deltas = [{"index": j, **c} for j, c in enumerate(calls)]
                yield chunk(i, {"tool_calls": deltas})
            finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
            yield chunk(i, {}, finish)
        if req.include_usage():
            done = sum(len(s.token_ids) for s in streams)
            usage = wire.usage(prompt_len, done, cached_tokens(group.handles[:1]))
            yield sse(wire.chat_chunk(rid, server.model_name, created, [], usage, server.loop.engine.policy_version))
        rid, headers, ids, tool_list, t0 = log_args
        server.record(rid, req, headers, ids, tool_list, group, streams, t0, stream=True)
        yield "data: [DONE]\n\n"
    except (EngineFailed, ValueError) as e:
        yield sse(wire.error_body(f"the request failed: {e}", kind="server_error"))
    finally:
        server.loop.abort(group)


async def stream_text(server: OpenAIServer, req: wire.CompletionRequest, group: Group, streams: list[TextStream],
                       prompts: list[list[int]], prompt_tokens: int) -> AsyncIterator[str]:
    rid, created = wire.new_id("cmpl"), int(time.time())
    sent = [""] * len(streams)
    try:
        for i in range(len(streams)) if req.echo else ():
            yield sse(wire.text_completion(rid, server.model_name, created, [
                {"index": i, "text": server.echo(req, prompts[i // req.n]), "finish_reason": None, "logprobs": None}], None))
        async for i, out in group:
            s = streams[i]
            first = len(s.token_ids)
            s.add(out.new_token_ids, out.new_logprobs, out.new_top_logprobs)
            shown = server.final_text(group.handles[i], s) if out.finished else s.visible()
            lp = (wire.completion_logprobs(s.token_strings(first), out.new_logprobs, len(sent[i]),
                                           s.top_strings(first)) if req.logprobs is not None else None)
            delta = shown[len(sent[i]):]
            sent[i] = shown
            if delta or lp or out.finished:
                choice = {"index": i, "text": delta, "logprobs": lp,
                          "finish_reason": out.finish_reason if out.finished else None}
                yield sse(wire.text_completion(rid, server.model_name, created, [choice], None))
        if req.include_usage():
            usage = wire.usage(prompt_tokens, sum(len(s.token_ids) for s in streams), cached_tokens(group.handles))
            yield sse(wire.text_completion(rid, server.model_name, created, [], usage))
        yield "data: [DONE]\n\n"
    except (EngineFailed, ValueError) as e:
        yield sse(wire.error_body(f"the request failed: {e}", kind="server_error"))
    finally:
        server.loop.abort(group)



def cached_tokens(handles: list[Handle]) -> int:
    """Prompt tokens the engine served from its prefix cache, over ``handles``."""
    return sum(h.completion.cached_prompt_tokens for h in handles if h.completion is not None)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
