"""What the model is told: the system prompt, the tool schemas and the harness's nudges.

Deployment (``opencomposer agent``), evaluation and RL rollouts all take these from here,
so a policy is trained on exactly the prompt it is deployed with. The prompt names no
absolute path and no per-task detail: every rollout shares one prefix, which keeps
prefix caches warm. The edit tools offered (``AgentConfig.edit_tools``) change the tool list
and the one line of the prompt that says how to edit, and ``AgentConfig.lint_tool`` adds the lint
tool and a sentence on it; the default config gives ``SYSTEM_PROMPT``.

Test: ``pytest tests/unit/harness/test_loop.py tests/unit/harness/test_replace_lines.py``.
"""

from __future__ import annotations

from typing import Any

from opencomposer.config import AgentConfig
from opencomposer.harness.tools import TOOLS, offered, tool_schemas
from opencomposer.harness.trajectory import Trajectory

_PROMPT = """\
You are an expert software engineer. You work in a code repository through tools: you read, \
search, edit and run code until the task is done.

- The workspace is the repository root. Every path is relative to it, and commands run there.
- Explore first: list_dir, search and read_file show you the code you need.{lint}
- {edit}
- Check your work with run (the tests, or a short script) when you can.
- Every turn, make one or more tool calls. Text without a tool call does nothing.
- When the task is done, call submit with a short summary of what you changed. The episode \
ends there: you cannot act after submit."""


_HOW_TO_EDIT = {
    "edit_file": "Edit with edit_file: `old` must match the file exactly, indentation included, and occur once.",
    "replace_lines": "Edit with replace_lines: give the line numbers read_file shows (start_line to end_line, "
                     "inclusive) and the new lines; the numbers below an edit move, so read again before the next.",
}


def _how_to_edit(edit_tools: list[str]) -> str:
    parts = [_HOW_TO_EDIT[t] for t in ("edit_file", "replace_lines") if t in edit_tools]
    if len(parts) == 2:
        parts[1] = "Or edit by line numbers" + parts[1].removeprefix("Edit")
    if "write_file" in edit_tools:
        parts.append("Use write_file for new files." if parts else "Edit by writing the whole file with write_file.")
    return " ".join(parts)


def system_prompt(cfg: AgentConfig | None = None) -> str:
    """The system prompt for ``cfg``'s tools (tool schemas travel separately, as ``tools=``)."""
    cfg = cfg or AgentConfig()
    lint = (" lint lists a Python file's errors (undefined names, unused variables) with their line numbers."
            if cfg.lint_tool else "")
    return _PROMPT.format(edit=_how_to_edit(cfg.edit_tools), lint=lint)


SYSTEM_PROMPT = system_prompt()  # the default config's


def agent_tools(cfg: AgentConfig | None = None) -> list[dict[str, Any]]:
    """The tool schemas a policy is given under ``cfg``, in a fixed order."""
    return tool_schemas(cfg)


def episode_tools(traj: Trajectory) -> list[dict[str, Any]]:
    """The tool schemas ``traj``'s episode was given, to render its prompts again for training."""
    return [TOOLS[name].schema for name in traj.tools] if traj.tools else agent_tools()


def no_call_nudge(cut_off: bool, cfg: AgentConfig | None = None) -> str:
    """The user message that answers a turn without any tool call."""
    why = "Your reply was cut off before any tool call; be briefer. " if cut_off else ""
    return (
        f"{why}You did not call a tool, so nothing happened. Continue with the tools "
        f"({', '.join(offered(cfg))}); when the task is done, call submit with a short summary."
    )
