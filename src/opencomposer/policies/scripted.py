"""``ScriptedPolicy``: a deterministic policy that plays back canned turns, for tests and demos.

    policy = ScriptedPolicy([
        [tool_call("read_file", path="setup.py")],
        "<tool_call>\\n{\\"name\\": \\"submit\\", \\"arguments\\": {\\"message\\": \\"done\\"}}\\n</tool_call>",
    ])

Each turn is a ``PolicyOutput``, a list of ``ToolCall`` or raw model text (parsed with the
Hermes codec, exactly as a local model's output would be). It remembers the messages it
was shown (``seen``) so tests can check what the model would have read. When the
script runs out it raises, which the loop records as ``policy_error``.

Test: ``pytest tests/unit/harness/test_loop.py``.
"""

from __future__ import annotations

from typing import Any

from opencomposer.models.codec import parse_tool_calls
from opencomposer.protocols import Message, PolicyOutput, ToolCall

Turn = PolicyOutput | list[ToolCall] | str


def tool_call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name, arguments)


class ScriptOver(RuntimeError):
    """The scripted policy was asked for more turns than it holds."""


class ScriptedPolicy:
    name = "scripted"

    def __init__(self, turns: list[Turn]):
        self.turns = list(turns)
        self.seen: list[list[Message]] = []
        self.tools: list[dict[str, Any]] = []

    def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> PolicyOutput:
        self.seen.append(list(messages))
        self.tools = tools
        k = len(self.seen) - 1
        if k >= len(self.turns):
            raise ScriptOver(f"scripted policy has {len(self.turns)} turns; asked for turn {k + 1}")
        turn = self.turns[k]
        if isinstance(turn, PolicyOutput):
            return turn
        if isinstance(turn, str):
            return PolicyOutput(text=turn, tool_calls=parse_tool_calls(turn)[1])
        return PolicyOutput(text="", tool_calls=[ToolCall(c.name, dict(c.arguments), c.id, c.raw, c.error) for c in turn])
