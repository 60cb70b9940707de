"""Self-summarisation: how a long episode continues past its context window.

When the conversation passes ``AgentConfig.summarize_at`` tokens, the loop appends
``SUMMARY_REQUEST`` as a user message and the policy answers with a summary of its work
(tool calls in that answer are not run). The next *segment* then starts from scratch:

    system prompt, the task, a user message "SUMMARY_HEADER + summary"
    (+ the last ``summary_keep_turns`` turns, as text, if configured)

and the episode goes on, as often as needed (at most ``max_summaries`` times). The
trajectory keeps every earlier segment's messages (``Trajectory.segments``), each ending
with the request and the summary, so training replays every segment exactly as the
model saw it: each segment is its own training sequence and all of them share the
chain's final reward (``rl/samples.turn_contexts``).

The prompts are fixed strings (like the system prompt) so a policy trained on them sees
the same words in deployment; ``is_summary_request`` / ``summary_of`` let scripted
policies (the oracle) recognise them.

Test: ``pytest tests/unit/harness/test_summarize.py``.
"""

from __future__ import annotations

import json

from opencomposer.protocols import Message

SUMMARY_REQUEST = (
    "Your context is nearly full and will be cleared. Write a summary for yourself to "
    "continue from: the task, what you found (files, functions, line numbers), what you "
    "changed so far, and what is left to do. Reply with the summary only, no tool calls."
)
SUMMARY_HEADER = "Summary of your work so far (your earlier context was cleared):\n\n"
RECENT_HEADER = "\n\nYour most recent turns before the summary:\n"
OBSERVATION_CHARS = 600  # of each kept observation


def summary_request() -> Message:
    return Message("user", SUMMARY_REQUEST)


def is_summary_request(message: Message) -> bool:
    return message.role == "user" and message.content == SUMMARY_REQUEST


def summary_of(messages: list[Message]) -> str | None:
    """The summary a segment starts from, or None for the first segment of an episode."""
    for m in messages:
        if m.role == "user" and m.content.startswith(SUMMARY_HEADER):
            return m.content[len(SUMMARY_HEADER):]
    return None


def recent_turns(messages: list[Message], keep_turns: int) -> str:
    """The last ``keep_turns`` assistant turns of ``messages`` and their observations, as text."""
    if keep_turns <= 0:
        return ""
    starts = [i for i, m in enumerate(messages) if m.role == "assistant" and not _is_summary_turn(messages, i)]
    lines = []
    for i in starts[-keep_turns:]:
        m = messages[i]
        if m.content.strip():
            lines.append(f"- you wrote: {m.content.strip()}")
        for c in m.tool_calls:
            lines.append(f"- you called {c.name}({json.dumps(c.arguments, ensure_ascii=False)})")
        for o in messages[i + 1:]:
            if o.role != "tool":
                break
            text = o.content if len(o.content) <= OBSERVATION_CHARS else o.content[:OBSERVATION_CHARS] + " [...]"
            lines.append(f"  -> {text}")
    return RECENT_HEADER + "\n".join(lines) if lines else ""


def _is_summary_turn(messages: list[Message], i: int) -> bool:
    return i > 0 and is_summary_request(messages[i - 1])


def next_segment(previous: list[Message], summary: str, keep_turns: int = 0) -> list[Message]:
    """The messages a new segment starts with: system prompt, task, summary (+ recent turns)."""
    system, task = previous[0], previous[1]
    body = summary.strip() or "(the summary was empty)"
    return [system, task, Message("user", SUMMARY_HEADER + body + recent_turns(previous, keep_turns))]
