"""``OpenAIPolicy``: any OpenAI-compatible chat-completions endpoint as a Policy.

    policy = OpenAIPolicy("gpt-4.1-mini")                                  # api.openai.com
    policy = OpenAIPolicy("qwen", base_url="http://localhost:8000/v1")     # vLLM, SGLang, ours

Tools go as ``tools=`` (native function calling), so the server's chat template decides
how the model sees them. Our ``Message`` list maps onto OpenAI messages one to one
(assistant ``tool_calls``; ``tool`` messages answering by ``tool_call_id``). A returned
call whose arguments are not a JSON object comes back as a ``ToolCall`` with ``error``
set, so the loop answers it and counts it as invalid. HTTP errors (after the client's
retries) propagate; the loop ends the episode with ``policy_error``.

Test: ``pytest tests/unit/policies/test_openai.py`` (a real HTTP server in a thread).
"""

from __future__ import annotations

import json
import os
from typing import Any

from opencomposer.protocols import POLICY_FINGERPRINT, Message, PolicyOutput, ToolCall


def to_openai_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Our messages in the chat-completions wire format."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            out.append({"role": "tool", "tool_call_id": m.tool_call_id or "", "content": m.content})
        elif m.role == "assistant" and m.tool_calls:
            calls = [
                {
                    "id": c.id,
                    "type": "function",
                    # A call that could not be parsed goes back as the model wrote it.
                    "function": {"name": c.name or "invalid", "arguments": c.raw if c.error else json.dumps(c.arguments)},
                }
                for c in m.tool_calls
            ]
            out.append({"role": "assistant", "content": m.content or None, "tool_calls": calls})
        else:
            out.append({"role": m.role, "content": m.content})
    return out


def parse_arguments(name: str, call_id: str, arguments: str | None) -> ToolCall:
    """One returned call; unreadable arguments give a ToolCall with ``error`` set."""
    raw = arguments or ""
    if not raw.strip():
        return ToolCall(name, {}, call_id)  # some servers send "" for a call without arguments
    try:
        args = json.loads(raw)
        if isinstance(args, str):  # double-encoded: a JSON string holding the JSON object
            args = json.loads(args)
    except json.JSONDecodeError as e:
        return ToolCall(name, {}, call_id, raw, f"arguments of {name!r} are not valid JSON: {e.msg} at char {e.pos}")
    if not isinstance(args, dict):
        return ToolCall(name, {}, call_id, raw, f"arguments of {name!r} must be a JSON object, got {type(args).__name__}")
    return ToolCall(name, args, call_id)


def from_openai_response(resp: Any) -> PolicyOutput:
    """The first choice of a ChatCompletion as a PolicyOutput. From ``opencomposer serve``,
    the policy version that answered comes from ``system_fingerprint``."""
    if not resp.choices:
        raise RuntimeError("the endpoint returned no choices")
    choice = resp.choices[0]
    msg = choice.message
    calls = []
    for i, tc in enumerate(msg.tool_calls or []):
        fn = getattr(tc, "function", None)
        if fn is None:  # a non-function tool type: keep it visible as an invalid call
            calls.append(ToolCall("", {}, tc.id or f"call_{i}", str(tc), f"unsupported tool call type {tc.type!r}"))
            continue
        calls.append(parse_arguments(fn.name or "", tc.id or f"call_{i}", fn.arguments))
    usage = resp.usage
    return PolicyOutput(
        text=msg.content or "",
        tool_calls=calls,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        completion_tokens=usage.completion_tokens if usage else 0,
        finish_reason=choice.finish_reason or "stop",
        policy_version=_served_version(getattr(resp, "system_fingerprint", None) or ""),
    )


def _served_version(fingerprint: str) -> int:
    """The policy version an ``opencomposer serve`` answered with; 0 from other servers."""
    version = fingerprint.removeprefix(POLICY_FINGERPRINT)
    return int(version) if fingerprint.startswith(POLICY_FINGERPRINT) and version.isdigit() else 0


class OpenAIPolicy:
    """A Policy backed by ``openai.OpenAI().chat.completions.create(..., tools=...)``."""

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        timeout: float = 300.0,
        max_retries: int = 2,
        extra_body: dict[str, Any] | None = None,
        name: str | None = None,
        http_client: Any = None,  # an ``httpx.Client`` of the caller's, e.g. with hooks reading response headers
    ):
        from openai import OpenAI  # imported here: only this policy needs the client

        # Local servers accept any key, but the client refuses to start without one.
        key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.client = OpenAI(base_url=base_url, api_key=key, timeout=timeout, max_retries=max_retries,
                             http_client=http_client)
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.extra_body = extra_body or {}
        self.name = name or f"openai:{model}"

    def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> PolicyOutput:
        kwargs: dict[str, Any] = {"temperature": self.temperature}
        if tools:
            kwargs.update(tools=tools, tool_choice="auto")
        if self.max_tokens is not None:
            kwargs["max_tokens"] = self.max_tokens
        if self.extra_body:
            kwargs["extra_body"] = self.extra_body
        resp = self.client.chat.completions.create(
            model=self.model, messages=to_openai_messages(messages), **kwargs
        )
        return from_openai_response(resp)
