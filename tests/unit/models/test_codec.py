"""The Hermes <tool_call> codec: parsing a local model's text, and writing it back."""

from __future__ import annotations

import json

import pytest

from opencomposer.models.codec import format_assistant, format_tool_call, parse_tool_calls, tools_system_prompt
from opencomposer.harness.tools import tool_schemas
from opencomposer.protocols import ToolCall


def block(obj) -> str:
    body = obj if isinstance(obj, str) else json.dumps(obj)
    return f"<tool_call>\n{body}\n</tool_call>"


def test_several_calls_in_one_turn_keep_their_order_and_the_prose():
    text = "Let me look.\n" + block({"name": "list_dir", "arguments": {}}) + "\n" + block(
        {"name": "read_file", "arguments": {"path": "a.py", "start_line": 3}}
    )
    prose, calls = parse_tool_calls(text)
    assert prose == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == [
        ("list_dir", {}),
        ("read_file", {"path": "a.py", "start_line": 3}),
    ]
    assert all(c.error is None for c in calls)
    assert len({c.id for c in calls}) == 2


def test_malformed_json_is_kept_as_an_error_not_dropped():
    text = block('{"name": "read_file", "arguments": {"path": "a.py"') + block({"name": "submit", "arguments": {"message": "x"}})
    _, calls = parse_tool_calls(text)
    assert len(calls) == 2
    bad, good = calls
    assert bad.error and "malformed JSON" in bad.error
    assert '"path": "a.py"' in bad.raw
    assert good.error is None and good.name == "submit"


def test_unknown_tool_name_parses_and_is_left_to_the_harness():
    _, (call,) = parse_tool_calls(block({"name": "frobnicate", "arguments": {"x": 1}}))
    assert call.name == "frobnicate" and call.error is None


def test_double_encoded_arguments_are_decoded():
    inner = json.dumps({"path": "setup.py"})
    _, (call,) = parse_tool_calls(block({"name": "read_file", "arguments": inner}))
    assert call.arguments == {"path": "setup.py"} and call.error is None


def test_double_encoded_garbage_and_non_object_arguments_are_errors():
    _, (a,) = parse_tool_calls(block({"name": "read_file", "arguments": "{path: x"}))
    _, (b,) = parse_tool_calls(block({"name": "read_file", "arguments": [1, 2]}))
    _, (c,) = parse_tool_calls(block({"arguments": {}}))
    _, (d,) = parse_tool_calls(block("[1, 2]"))
    assert "not valid JSON" in a.error and a.name == "read_file"
    assert "must be a JSON object" in b.error
    assert '"name"' in c.error
    assert "JSON object" in d.error


def test_unclosed_final_block_still_counts():
    text = 'ok\n<tool_call>\n{"name": "run", "arguments": {"command": "ls"}}'
    prose, (call,) = parse_tool_calls(text)
    assert prose == "ok"
    assert call.name == "run" and call.arguments == {"command": "ls"}


def test_text_without_calls():
    assert parse_tool_calls("just thinking") == ("just thinking", [])


def test_format_assistant_round_trips_good_and_broken_calls():
    _, calls = parse_tool_calls(block({"name": "run", "arguments": {"command": "ls"}}) + block("{oops"))
    text = format_assistant("thinking", calls)
    prose, again = parse_tool_calls(text)
    assert prose == "thinking"
    assert again[0].arguments == {"command": "ls"}
    assert again[1].error and again[1].raw.strip() == "{oops"


def test_format_tool_call_is_parseable():
    text = format_assistant("", [ToolCall("edit_file", {"path": "é.py", "old": "a\n", "new": "b"})])
    _, (call,) = parse_tool_calls(text)
    assert call.arguments == {"path": "é.py", "old": "a\n", "new": "b"}


def test_tools_system_prompt_lists_every_schema():
    prompt = tools_system_prompt(tool_schemas())
    for schema in tool_schemas():
        assert json.dumps(schema) in prompt
    assert "<tool_call>" in prompt


# --- the xml syntax: arguments as plain text (Qwen3-Coder's convention) ---------------------------

CODE = 'def f(x):\n    """Say "hi"\\n"""\n    return {"a": x}  # <not a tag>\n'


def test_xml_call_writes_code_unescaped_and_round_trips():
    call = ToolCall("edit_file", {"path": "a.py", "old": "    pass\n", "new": CODE}, "c1")
    text = format_assistant("Fix it.", [call], "xml")
    assert CODE in text and "\\n" not in text.replace('\\\\n', '')[: text.index(CODE)]
    assert text.startswith("Fix it.\n<tool_call>\n<function=edit_file>\n<parameter=path>\na.py\n</parameter>")
    prose, calls = parse_tool_calls(text)
    assert prose == "Fix it."
    assert [(c.name, c.arguments, c.error) for c in calls] == [("edit_file", call.arguments, None)]


def test_xml_values_keep_inner_blank_lines_and_indentation():
    text = "<tool_call>\n<function=write_file>\n<parameter=content>\n\n    x = 1\n\n</parameter>\n</function>\n</tool_call>"
    [c] = parse_tool_calls(text)[1]
    assert c.arguments == {"content": "\n    x = 1\n"}


def test_json_and_xml_calls_parse_in_one_turn():
    text = (block({"name": "list_dir", "arguments": {"path": "."}}) + "\n"
            + format_tool_call(ToolCall("read_file", {"path": "a.py", "start_line": 3}, "x"), "xml"))
    calls = parse_tool_calls(text)[1]
    assert [(c.name, c.arguments) for c in calls] == [("list_dir", {"path": "."}),
                                                       ("read_file", {"path": "a.py", "start_line": "3"})]


@pytest.mark.parametrize("body, error", [
    ("<function=>\n</function>", "needs <function=NAME>"),
    ("<function=run>\n<parameter=command>\nls\n", "not closed"),
    ("<function=run>\n<parameter=>\nls\n</parameter>\n</function>", "needs a name"),
    ("<function=run>\n<parameter=command>\nls\n</parameter>\n<parameter=command>\npwd\n</parameter>\n</function>",
     "given twice"),
])
def test_broken_xml_calls_are_errors_not_dropped(body, error):
    [c] = parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>")[1]
    assert c.error and error in c.error and c.raw


def test_xml_preamble_and_unknown_syntax():
    text = tools_system_prompt(tool_schemas(), "xml")
    assert "<function=example_function>" in text and all(json.dumps(t) in text for t in tool_schemas())
    with pytest.raises(ValueError, match="tool_syntax 'yaml'"):
        tools_system_prompt(tool_schemas(), "yaml")
