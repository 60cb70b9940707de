"""Tool-call codec: how tool calls look inside a local model's text, both ways.

Tools are described with the OpenAI function-calling schema. Local models see them in
the Hermes/Qwen convention: the schemas inside ``<tools>...</tools>`` in the system
prompt, and each call the model makes as

    <tool_call>
    {"name": "read_file", "arguments": {"path": "setup.py"}}
    </tool_call>

Several calls per turn are allowed. ``parse_tool_calls`` never drops a call it cannot
read: a broken one comes back as a ``ToolCall`` with ``error`` set, so the harness can
answer with an error observation and count it as invalid.

Test: ``pytest tests/unit/models/test_codec.py``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from opencomposer.protocols import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_CALL_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)
_BLOCK = TOOL_CALL_BLOCK

TOOLS_PREAMBLE = (
    "You may call one or more functions to do the task. The function signatures are "
    "inside <tools></tools>:\n<tools>\n{schemas}\n</tools>\n\n"
    "For each call, write a JSON object with the function name and its arguments inside "
    "<tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The part of the system prompt that lists the tools (one JSON schema per line)."""
    schemas = "\n".join(json.dumps(t, sort_keys=False) for t in tools)
    return TOOLS_PREAMBLE.format(schemas=schemas)


def format_tool_call(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def format_assistant(content: str, calls: list[ToolCall]) -> str:
    """Assistant text as the model would have written it: prose, then its calls."""
    parts = [content.strip()] if content.strip() else []
    parts += [format_tool_call(c) if not c.raw else f"{OPEN}{c.raw}{CLOSE}" for c in calls]
    return "\n".join(parts)


def _parse_one(raw: str, index: int) -> ToolCall:
    call_id = f"call_{index}"
    text = raw.strip()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCall("", {}, call_id, raw, f"malformed JSON in <tool_call>: {e.msg} at char {e.pos}")
    if not isinstance(obj, dict):
        return ToolCall("", {}, call_id, raw, "a <tool_call> must hold a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, call_id, raw, 'a <tool_call> needs a string "name"')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ToolCall(name, {}, call_id, raw, f'"arguments" is not valid JSON: {e.msg}')
    if not isinstance(args, dict):
        return ToolCall(name, {}, call_id, raw, '"arguments" must be a JSON object')
    return ToolCall(name, args, call_id, "")


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split assistant text into (prose, calls). An unclosed final block still counts."""
    calls = [_parse_one(m.group(1), i) for i, m in enumerate(_BLOCK.finditer(text))]
    prose = _BLOCK.sub("", text).strip()
    return prose, calls
