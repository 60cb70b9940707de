"""Tool-call codec: how tool calls look inside a local model's text, both ways.

Tools are described with the OpenAI function-calling schema. Local models see them in
the Hermes/Qwen convention: the schemas inside ``<tools>...</tools>`` in the system
prompt, and each call the model makes as

    <tool_call>
    {"name": "read_file", "arguments": {"path": "setup.py"}}
    </tool_call>

or, with the ``xml`` syntax (the convention of Qwen3-Coder's chat template), with every
argument as plain text, so code is written as code and not as an escaped JSON string:

    <tool_call>
    <function=edit_file>
    <parameter=path>
    solution.py
    </parameter>
    <parameter=new>
        return number % 1.0
    </parameter>
    </function>
    </tool_call>

The syntax is the model's (``[model] tool_syntax``; ``models/chat.py`` keeps it on the
tokenizer) and decides how calls and the tool preamble are *written*. Reading accepts both
in every block, so a model that switches syntax mid-turn is still understood. An ``xml``
value is text (a ``TextValue``; one newline after the opening tag and one before the closing
tag are the syntax's, not the value's), so the harness converts ``"12"`` for an integer
parameter (``harness/tools.typed_args``); a JSON string stays a string, its type checked.

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

SYNTAXES = ("json", "xml")
TOOLS_PREAMBLE = (
    "You may call one or more functions to do the task. The function signatures are "
    "inside <tools></tools>:\n<tools>\n{schemas}\n</tools>\n\n"
    "For each call, write a JSON object with the function name and its arguments inside "
    "<tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


XML_TOOLS_PREAMBLE = (
    "You may call one or more functions to do the task. The function signatures are "
    "inside <tools></tools>:\n<tools>\n{schemas}\n</tools>\n\n"
    "For each call, write the function name and each argument inside <tool_call></tool_call> "
    "tags, every value as plain text (code as code, no escaping):\n"
    "<tool_call>\n<function=example_function>\n<parameter=example_parameter>\n"
    "value, which may span lines\n</parameter>\n</function>\n</tool_call>"
)
_FUNCTION = re.compile(r"<function=([^>\s]*)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]*)>(.*?)(</parameter>|\Z)", re.S)


class TextValue(str):
    """An argument written as plain text (the ``xml`` syntax): its type is the tool schema's to decide."""


def check_syntax(syntax: str) -> str:
    if syntax not in SYNTAXES:
        raise ValueError(f"tool_syntax {syntax!r}: expected one of {', '.join(SYNTAXES)}")
    return syntax


def tools_system_prompt(tools: list[dict[str, Any]], syntax: str = "json") -> str:
    """The part of the system prompt that lists the tools (one JSON schema per line)."""
    schemas = "\n".join(json.dumps(t, sort_keys=False) for t in tools)
    preamble = XML_TOOLS_PREAMBLE if check_syntax(syntax) == "xml" else TOOLS_PREAMBLE
    return preamble.format(schemas=schemas)


def format_tool_call(call: ToolCall, syntax: str = "json") -> str:
    if check_syntax(syntax) == "xml":
        params = [f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>"
                  for k, v in call.arguments.items()]
        body = "\n".join([f"<function={call.name}>", *params, "</function>"])
    else:
        body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def format_assistant(content: str, calls: list[ToolCall], syntax: str = "json") -> str:
    """Assistant text as the model would have written it: prose, then its calls."""
    parts = [content.strip()] if content.strip() else []
    parts += [format_tool_call(c, syntax) if not c.raw else f"{OPEN}{c.raw}{CLOSE}" for c in calls]
    return "\n".join(parts)


def _parse_xml(raw: str, call_id: str) -> ToolCall:
    """One ``<function=NAME>`` block: its ``<parameter=KEY>`` values, as strings."""
    m = _FUNCTION.search(raw)
    name = m.group(1) if m else ""
    if not name:
        return ToolCall("", {}, call_id, raw, "a <tool_call> needs <function=NAME> with a name")
    args: dict[str, Any] = {}
    for p in _PARAMETER.finditer(m.group(2)):
        key, value, closed = p.group(1), p.group(2), p.group(3)
        if not key:
            return ToolCall(name, {}, call_id, raw, "a <parameter=NAME> needs a name")
        if not closed:
            return ToolCall(name, {}, call_id, raw, f"<parameter={key}> is not closed with </parameter>")
        if key in args:
            return ToolCall(name, {}, call_id, raw, f"<parameter={key}> is given twice")
        value = value[1:] if value.startswith("\n") else value
        args[key] = TextValue(value[:-1] if value.endswith("\n") else value)
    return ToolCall(name, args, call_id, "")


def _parse_one(raw: str, index: int) -> ToolCall:
    call_id = f"call_{index}"
    text = raw.strip()
    if text.startswith("<function"):
        return _parse_xml(raw, call_id)
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
