"""What the model is told: the system prompt, the tool schemas and the harness's nudges.

Deployment (``opencomposer agent``), evaluation and RL rollouts all take these from here,
so a policy is trained on exactly the prompt it is deployed with. The prompt names no
absolute path and no per-task detail: every rollout shares one prefix, which keeps
prefix caches warm.

Test: ``pytest tests/unit/harness/test_loop.py``.
"""

from __future__ import annotations

from typing import Any

from opencomposer.harness.tools import TOOLS, tool_schemas

SYSTEM_PROMPT = """\
You are an expert software engineer. You work in a code repository through tools: you read, \
search, edit and run code until the task is done.

- The workspace is the repository root. Every path is relative to it, and commands run there.
- Explore first: list_dir, search and read_file show you the code you need.
- Edit with edit_file: `old` must match the file exactly, indentation included, and occur \
once. Use write_file for new files.
- Check your work with run (the tests, or a short script) when you can.
- Every turn, make one or more tool calls. Text without a tool call does nothing.
- When the task is done, call submit with a short summary of what you changed. The episode \
ends there: you cannot act after submit."""


def system_prompt() -> str:
    """The default system prompt (tool schemas travel separately, as ``tools=``)."""
    return SYSTEM_PROMPT


def agent_tools() -> list[dict[str, Any]]:
    """The tool schemas every policy is given, in a fixed order."""
    return tool_schemas()


def no_call_nudge(cut_off: bool) -> str:
    """The user message that answers a turn without any tool call."""
    why = "Your reply was cut off before any tool call; be briefer. " if cut_off else ""
    return (
        f"{why}You did not call a tool, so nothing happened. Continue with the tools "
        f"({', '.join(TOOLS)}); when the task is done, call submit with a short summary."
    )
