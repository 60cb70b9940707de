"""OpenAI chat messages + tools <-> the prompt text and the model's tool calls.

The served prompt must be byte-identical to what training renders for the same
conversation, so this module never assembles chat text itself: it turns the wire-format
messages back into harness ``Message`` objects (the inverse of
``harness.openai_policy.to_openai_messages``) and hands them to ``models.chat.render_prompt``,
the one prompt builder. Tool calls are read out of the generated text with the harness
codec (Hermes ``<tool_call>`` blocks) and returned in OpenAI's ``tool_calls`` shape.

    prompt = render_chat(tokenizer, request_messages, tools)
    content, calls = split_tool_calls(generated_text)

Test: ``pytest tests/unit/inference/test_server_chat_format.py``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from opencomposer.models import codec
from opencomposer.models.chat import render_prompt
from opencomposer.protocols import Message, ToolCall

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatFormatError(ValueError):
    """A request's messages or tools that cannot be rendered; ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """The prompt text for OpenAI-format ``messages`` and ``tools``, ending in the assistant header."""
    return render_prompt(tokenizer, from_openai_messages(messages), tools)


def from_openai_messages(messages: list[dict[str, Any]]) -> list[Message]:
    """Wire-format messages -> harness messages; the inverse of ``to_openai_messages``."""
    if not messages:
        raise ChatFormatError("messages", "must hold at least one message")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatFormatError(where, f"must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"{where}.role", f"got {role!r}; expected one of {ROLES}")
        content = _text(m.get("content"), f"{where}.content")
        if role == "assistant":
            calls = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m.get("tool_calls") or [])]
            out.append(Message("assistant", content, calls))
        elif role == "tool":
            out.append(Message("tool", content, tool_call_id=m.get("tool_call_id"), name=m.get("name")))
        else:  # OpenAI's "developer" role is the newer name of "system"
            out.append(Message("system" if role == "developer" else role, content))
    return out


def _text(content: Any, where: str) -> str:
    """Message content: a string, null, or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatFormatError(f"{where}[{j}]", f"only text parts are supported, got {kind!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatFormatError(where, f"must be a string or a list of text parts, got {type(content).__name__}")


def _tool_call(call: Any, where: str) -> ToolCall:
    """An assistant ``tool_calls`` entry as the ToolCall that renders back to the model's text."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ChatFormatError(where, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
    fn = call["function"]
    name, raw = fn.get("name") or "", fn.get("arguments")
    if not isinstance(raw, str):
        raise ChatFormatError(f"{where}.function.arguments", f"must be a JSON string, got {type(raw).__name__}")
    try:
        args = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as e:
        args = e
    if isinstance(args, dict):
        return ToolCall(name, args, call.get("id") or "")
    # A call the model wrote unreadably comes back as its raw text (see split_tool_calls);
    # rendering it verbatim reproduces the prompt training built from the same turn.
    return ToolCall(name, {}, call.get("id") or "", raw=raw, error="unreadable arguments")


def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Generated text -> (content, OpenAI ``tool_calls``). Without calls the content is the
    text unchanged; with calls it is the prose around them, or None when there is none.

    A ``<tool_call>`` block that does not parse is still returned, as a call whose
    ``arguments`` is the block's raw text: the client sees (and can count) the invalid
    call, and sending it back in the history renders the block exactly as written.
    """
    prose, calls = codec.parse_tool_calls(text)
    if not calls:
        return text, []
    out = []
    for c in calls:
        arguments = c.raw if c.error else json.dumps(c.arguments, ensure_ascii=False)
        out.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": c.name, "arguments": arguments}})
    return (prose or None), out


def content_before_tool_call(text: str) -> str:
    """The part of streamed text that is certainly prose: everything before a ``<tool_call>``
    tag, minus a tail that might be the start of one."""
    cut = text.find(codec.OPEN)
    if cut >= 0:
        return text[:cut]
    for k in range(min(len(codec.OPEN) - 1, len(text)), 0, -1):
        if codec.OPEN.startswith(text[-k:]):
            return text[:-k]
    return text


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """Check OpenAI function-tool schemas; returns them unchanged (their key order is what
    the model sees) or raises ``ChatFormatError`` naming the bad field."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatFormatError("tools", f"must be a list, got {type(tools).__name__}")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ChatFormatError(where, f"must be an object, got {type(t).__name__}")
        if t.get("type") != "function":
            raise ChatFormatError(f"{where}.type", f"got {t.get('type')!r}; only 'function' tools are supported")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ChatFormatError(f"{where}.function", "missing or not an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(ch.isalnum() or ch in "_-" for ch in name):
            raise ChatFormatError(f"{where}.function.name", f"got {name!r}; expected 1-64 characters of a-z, A-Z, 0-9, _ or -")
        if name in seen:
            raise ChatFormatError(f"{where}.function.name", f"duplicate tool name {name!r}")
        seen.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise ChatFormatError(f"{where}.function.description", "must be a string")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise ChatFormatError(f"{where}.function.parameters", f"must be a JSON Schema object, got {type(params).__name__}")
            if params.get("type", "object") != "object":
                raise ChatFormatError(f"{where}.function.parameters.type", f"got {params.get('type')!r}; expected 'object'")
            if not isinstance(params.get("properties", {}), dict):
                raise ChatFormatError(f"{where}.function.parameters.properties", "must be an object")
            req = params.get("required", [])
            if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
                raise ChatFormatError(f"{where}.function.parameters.required", "must be a list of property names")
    return tools
