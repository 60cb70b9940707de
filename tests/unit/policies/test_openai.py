"""OpenAIPolicy against a real HTTP server speaking the chat-completions wire format."""

from __future__ import annotations

import json

import pytest

from opencomposer.harness.loop import run_episode
from opencomposer.policies.openai import OpenAIPolicy, to_openai_messages
from opencomposer.harness.tools import tool_schemas
from opencomposer.protocols import Message, ToolCall
from testkit.openai_stub import FakeServer, completion


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def policy_for(server, **kw):
    return OpenAIPolicy("fake-model", base_url=server.url, api_key="sk-test", max_retries=0, timeout=10, **kw)


def test_request_carries_messages_tools_and_settings(server):
    server.replies.append((200, completion("hello", finish="stop")))
    history = [
        Message("system", "sys"),
        Message("user", "task"),
        Message("assistant", "", tool_calls=[ToolCall("read_file", {"path": "a.py"}, "c1"),
                                             ToolCall("", {}, "c2", raw="{bad", error="malformed")]),
        Message("tool", "obs1", tool_call_id="c1", name="read_file"),
        Message("tool", "Error: bad", tool_call_id="c2"),
    ]
    out = policy_for(server, temperature=0.7, max_tokens=99).act(history, tool_schemas())
    assert out.text == "hello" and out.tool_calls == [] and out.finish_reason == "stop"
    assert (out.prompt_tokens, out.completion_tokens) == (11, 7)
    (req,) = server.requests
    body = req["body"]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-test"
    assert body["model"] == "fake-model" and body["temperature"] == 0.7 and body["max_tokens"] == 99
    assert body["tools"] == tool_schemas() and body["tool_choice"] == "auto"
    assert body["messages"] == to_openai_messages(history)
    assistant = body["messages"][2]
    assert assistant["content"] is None
    assert assistant["tool_calls"][0] == {"id": "c1", "type": "function",
                                          "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    assert assistant["tool_calls"][1]["function"]["arguments"] == "{bad"
    assert body["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "obs1"}


def test_returned_tool_calls_are_parsed_and_bad_ones_kept_with_an_error(server):
    server.replies.append((200, completion("thinking", calls=[
        ("a", "read_file", '{"path": "x.py"}'),
        ("b", "run", '{"command": "ls"'),
        ("c", "read_file", json.dumps(json.dumps({"path": "y.py"}))),
        ("d", "list_dir", ""),
        ("e", "run", "[1]"),
    ])))
    out = policy_for(server).act([Message("user", "go")], tool_schemas())
    a, b, c, d, e = out.tool_calls
    assert (a.id, a.name, a.arguments, a.error) == ("a", "read_file", {"path": "x.py"}, None)
    assert b.error and "not valid JSON" in b.error and b.raw == '{"command": "ls"'
    assert c.arguments == {"path": "y.py"} and c.error is None
    assert d.arguments == {} and d.error is None
    assert "must be a JSON object" in e.error
    assert out.text == "thinking" and out.finish_reason == "tool_calls"


def test_a_whole_episode_over_http(server, sandbox, cfg):
    server.replies += [
        (200, completion(None, calls=[("call_x", "read_file", '{"path": "README.md"}')])),
        (200, completion(None, calls=[("call_y", "run", '{"command": "ls"')])),
        (200, completion("Done.", calls=[("call_z", "submit", '{"message": "read it"}')])),
    ]
    traj = run_episode("Read the README.", sandbox, policy_for(server), cfg)
    assert traj.exit_reason == "submitted" and traj.final_message == "read it"
    assert traj.invalid_calls == 1 and traj.prompt_tokens == 33
    second = server.requests[1]["body"]["messages"]
    assert second[-1]["role"] == "tool" and second[-1]["tool_call_id"] == "call_x" and "# calc" in second[-1]["content"]
    third = server.requests[2]["body"]["messages"]
    assert "not valid JSON" in third[-1]["content"] and third[-2]["tool_calls"][0]["function"]["arguments"] == '{"command": "ls"'


def test_an_http_error_ends_the_episode_as_policy_error(server, sandbox, cfg):
    server.replies.append((500, {"error": {"message": "boom", "type": "server_error"}}))
    traj = run_episode("x", sandbox, policy_for(server), cfg)
    assert traj.exit_reason == "policy_error" and "boom" in traj.error
