"""Shared fixtures (registered in tests/conftest.py): the tiny-random model and a small agent conversation.

``tiny-random`` is built once into the user's cache (about 5 s the first time, under a
second after), so these tests exercise the real loader, template and ``generate``.
"""

from __future__ import annotations

import pytest

from opencomposer.protocols import Message, ToolCall

READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file from the workspace",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    },
}
RUN = {
    "type": "function",
    "function": {
        "name": "run",
        "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}


@pytest.fixture(scope="session")
def tiny():
    from opencomposer.models import load_model

    return load_model("tiny-random")


@pytest.fixture
def tools():
    return [READ_FILE, RUN]


@pytest.fixture
def conversation():
    """System, task, one assistant turn with two calls, and both tool results."""
    return [
        Message("system", "You are a careful coding agent."),
        Message("user", "The tests in test_math.py fail. Fix them."),
        Message(
            "assistant",
            "Let me look at the code first.",
            [
                ToolCall("read_file", {"path": "math_utils.py"}, "call_0"),
                ToolCall("run", {"command": "pytest -q"}, "call_1"),
            ],
        ),
        Message("tool", "def add(a, b):\n    return a - b\n", tool_call_id="call_0", name="read_file"),
        Message("tool", "1 failed, 3 passed", tool_call_id="call_1", name="run"),
    ]
