"""The server's prompt is training's prompt; tool calls and streamed text come out right.

Real SmolLM2 tokenizer (from tiny-random), real chat template, real harness codec.
"""

from __future__ import annotations

import itertools

import pytest

from opencomposer.models import codec
from opencomposer.policies.openai import from_openai_response, to_openai_messages
from opencomposer.harness.tools import tool_schemas
from opencomposer.inference.server.chat_format import (
    ChatFormatError,
    content_before_tool_call,
    from_openai_messages,
    render_chat,
    split_tool_calls,
    validate_tools,
)
from opencomposer.inference.server.text_stream import TextStream
from opencomposer.models.chat import render_prompt
from opencomposer.protocols import Message, ToolCall


@pytest.fixture(scope="module")
def tok():
    from opencomposer.models import load_model

    return load_model("tiny-random")[1]


def harness_conversation() -> list[Message]:
    """An agent history with prose, two calls, an unreadable call, results, and a retry."""
    return [
        Message("system", "You are a careful coding agent."),
        Message("user", "Implement `mean` in mathy/stats.py."),
        Message("assistant", "Let me look.", [ToolCall("read_file", {"path": "mathy/stats.py"}, "call_0"),
                                              ToolCall("run", {"command": "pytest -q"}, "call_1")]),
        Message("tool", "def mean(xs):\n    raise NotImplementedError\n", tool_call_id="call_0"),
        Message("tool", "1 failed", tool_call_id="call_1"),
        Message("assistant", "", [ToolCall("", {}, "call_2", raw='\n{"name": "edit", "arguments": {oops}\n',
                                           error="malformed JSON")]),
        Message("tool", "error: malformed JSON in <tool_call>", tool_call_id="call_2"),
        Message("assistant", "Done.", []),
        Message("user", "Go on."),
    ]


def test_served_prompt_is_byte_identical_to_training_prompt(tok):
    msgs, tools = harness_conversation(), tool_schemas()
    # What the harness sends over the wire, decoded by the server, rendered by the server...
    wire = to_openai_messages(msgs)
    served = render_chat(tok, wire, tools)
    # ...equals what training renders from the same harness messages.
    assert served == render_prompt(tok, msgs, tools)
    assert "<tools>" in served and '"name": "edit", "arguments": {oops}' in served


def test_messages_map_back_one_to_one(tok):
    msgs = from_openai_messages(to_openai_messages(harness_conversation()))
    assert [m.role for m in msgs] == [m.role for m in harness_conversation()]
    assert msgs[2].tool_calls[0] == ToolCall("read_file", {"path": "mathy/stats.py"}, "call_0")
    assert msgs[5].tool_calls[0].raw.startswith('\n{"name": "edit"')
    # developer role and text-part lists, as newer clients send them
    dev = from_openai_messages([{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]}])
    assert (dev[0].role, dev[0].content) == ("system", "ab")


def test_generated_tool_calls_round_trip_through_the_harness_client():
    text = ('I will read it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "run", "arguments": {oops}\n</tool_call>')
    content, calls = split_tool_calls(text)
    assert content == "I will read it."
    assert [c["function"]["name"] for c in calls] == ["read_file", ""]
    assert calls[0]["function"]["arguments"] == '{"path": "a.py"}'
    assert calls[1]["function"]["arguments"] == '\n{"name": "run", "arguments": {oops}\n'
    # the harness's OpenAI client reads them as one good and one invalid call ...
    from openai.types.chat import ChatCompletion

    resp = ChatCompletion.model_validate({
        "id": "x", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls",
                     "message": {"role": "assistant", "content": content, "tool_calls": calls}}]})
    out = from_openai_response(resp)
    assert out.tool_calls[0].arguments == {"path": "a.py"} and out.tool_calls[0].error is None
    assert out.tool_calls[1].error is not None
    # ... and sending that turn back renders the model's own text again (modulo JSON spacing)
    back = from_openai_messages(to_openai_messages([Message("assistant", out.text, out.tool_calls)]))[0]
    assert codec.format_assistant(back.content, back.tool_calls) == codec.format_assistant(
        *codec.parse_tool_calls(text))


def test_text_without_calls_is_returned_unchanged():
    assert split_tool_calls("  just prose\n") == ("  just prose\n", [])


def test_streamed_prose_stops_before_a_tool_call_tag():
    assert content_before_tool_call("Hello <tool") == "Hello "
    assert content_before_tool_call("Hello <tool_call>\n{") == "Hello "
    assert content_before_tool_call("a < b") == "a < b"
    assert content_before_tool_call("x <") == "x "


@pytest.mark.parametrize("tools, param", [
    ({"type": "function"}, "tools"),
    ([{"type": "code_interpreter"}], "tools[0].type"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     "tools[0].function.parameters.type"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": []}}}],
     "tools[0].function.parameters.properties"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
     "tools[1].function.name"),
])
def test_invalid_tool_schemas_name_the_field(tools, param):
    with pytest.raises(ChatFormatError) as e:
        validate_tools(tools)
    assert e.value.param == param and str(e.value).startswith(param)


def test_valid_tools_pass_unchanged():
    tools = tool_schemas()
    assert validate_tools(tools) is tools


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0]"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}],
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_messages_name_the_field(messages, param):
    with pytest.raises(ChatFormatError) as e:
        from_openai_messages(messages)
    assert e.value.param == param


def test_text_stream_matches_a_full_decode_and_holds_back_stop_strings(tok):
    text = "déjà vu 日本語\n" * 12 + "line\nEND tail"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ts = TextStream(tok, stops=("END",))
    seen = []
    for t in ids:  # one token at a time, as the engine sends them
        ts.add([t], [-0.5])
        seen.append(ts.visible())
        assert "\ufffd" not in seen[-1] and "END" not in seen[-1]
    assert all(b.startswith(a) for a, b in itertools.pairwise(seen))  # never takes text back
    assert ts.final_text() == text.split("END")[0] == seen[-1]
    assert len(ts.token_ids) == len(ts.logprobs) == len(ids)


def test_text_stream_drops_a_final_stop_token(tok):
    ts = TextStream(tok)
    ids = tok("hi", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ts.add(ids, [0.0] * len(ids))
    assert ts.final_text(frozenset({tok.eos_token_id})) == "hi"
