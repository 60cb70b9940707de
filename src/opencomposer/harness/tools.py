"""The agent's tools: read, list, search, lint, edit, write, run, submit — the same in deployment and RL.

Which edit tools the agent is offered is ``AgentConfig.edit_tools`` (``edit_file``: old text ->
new text; ``replace_lines``: line numbers -> new text; ``write_file``: a whole file);
``lint`` (``harness/lint.py``: ruff's findings in a file) only where ``AgentConfig.lint_tool``;
``offered(cfg)`` names the tools of a config, and a call to a tool not offered is invalid,
like a call to an unknown one.

Each tool is a ``Tool``: an OpenAI function-calling schema plus a function
``(sandbox, args, cfg) -> observation``. ``execute(sandbox, call, cfg)`` is the one entry
point the loop uses: it checks the call against the schema, keeps every path inside the
workspace, runs the tool and always returns a ``ToolOutcome`` (an error observation
rather than an exception), except for ``submit``, which raises ``Submitted``.

Test: ``pytest tests/unit/harness/test_tools.py tests/unit/harness/test_replace_lines.py
tests/unit/harness/test_lint_tool.py``.
"""

from __future__ import annotations

import posixpath
import time
from dataclasses import dataclass
from typing import Any, Callable

from opencomposer.config import AgentConfig
from opencomposer.harness import fs_tools, shell_tools
from opencomposer.harness.lint import lint
from opencomposer.harness.fs_tools import ToolError
from opencomposer.models.codec import TextValue
from opencomposer.protocols import PathEscape, Sandbox, ToolCall


class Submitted(Exception):
    """Raised by the ``submit`` tool: the episode ends with ``message`` for the user."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[[Sandbox, dict[str, Any], AgentConfig], str]

    @property
    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class ToolOutcome:
    observation: str
    ok: bool  # the tool did what was asked
    invalid: bool = False  # the call itself was malformed: unknown tool, bad JSON, bad arguments
    seconds: float = 0.0


def _params(required: list[str], **props: tuple[str, str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {k: {"type": t, "description": d} for k, (t, d) in props.items()},
        "required": required,
        "additionalProperties": False,
    }


def _submit(sandbox: Sandbox, args: dict[str, Any], cfg: AgentConfig) -> str:
    raise Submitted(args["message"])


_PATH = ("string", "path relative to the workspace root")
TOOLS: dict[str, Tool] = {
    t.name: t
    for t in [
        Tool(
            "read_file",
            "Read a text file; lines come numbered. Long files are cut: read further with start_line.",
            _params(
                ["path"],
                path=_PATH,
                start_line=("integer", "first line to show, 1-based (default 1)"),
                end_line=("integer", "last line to show, inclusive (default: end of file)"),
            ),
            fs_tools.read_file,
        ),
        Tool(
            "list_dir",
            "List files and directories (directories end with /), skipping .git.",
            _params(
                [],
                path=("string", "directory relative to the workspace root (default '.')"),
                depth=("integer", "how many levels to descend, 1-5 (default 2)"),
            ),
            shell_tools.list_dir,
        ),
        Tool(
            "search",
            "Search file contents with a regular expression (PCRE); prints file:line:text.",
            _params(
                ["pattern"],
                pattern=("string", "regular expression, e.g. 'def parse_\\w+'"),
                path=("string", "file or directory to search (default '.')"),
                glob=("string", "only files whose name matches, e.g. '*.py'"),
            ),
            shell_tools.search,
        ),
        Tool(
            "lint",
            "Check a Python file for errors with ruff (undefined names, unused variables and imports, syntax); "
            "prints file:line:column: code message for each.",
            _params(["path"], path=("string", "a .py file relative to the workspace root")),
            lint,
        ),
        Tool(
            "edit_file",
            "Replace one exact occurrence of `old` with `new` in a file. `old` must match the file "
            "exactly (indentation included) and occur exactly once; include surrounding lines to make it unique.",
            _params(
                ["path", "old", "new"],
                path=_PATH,
                old=("string", "exact text to replace"),
                new=("string", "replacement text"),
            ),
            fs_tools.edit_file,
        ),
        Tool(
            "replace_lines",
            "Replace lines start_line to end_line (inclusive, numbered as read_file shows them) of a file "
            "with `new`. end_line = start_line - 1 inserts `new` before start_line; an empty `new` deletes "
            "the lines. Line numbers below an edit move: read the file again before the next edit.",
            _params(
                ["path", "start_line", "end_line", "new"],
                path=_PATH,
                start_line=("integer", "first line to replace, 1-based"),
                end_line=("integer", "last line to replace, inclusive (start_line - 1: insert, replace nothing)"),
                new=("string", "the new lines, indentation included ('' deletes the lines)"),
            ),
            fs_tools.replace_lines,
        ),
        Tool(
            "write_file",
            "Create or overwrite a file with `content` (parent directories are created).",
            _params(["path", "content"], path=_PATH, content=("string", "the whole new file content")),
            fs_tools.write_file,
        ),
        Tool(
            "run",
            "Run a bash command in the workspace root, e.g. tests. Shows the exit code and output.",
            _params(
                ["command"],
                command=("string", "the command line"),
                timeout=("number", "seconds before the command is killed (capped by the harness)"),
            ),
            shell_tools.run,
        ),
        Tool(
            "submit",
            "Finish the task: call once the work is done, with a short message for the user.",
            _params(["message"], message=("string", "what you changed and why, in a few sentences")),
            _submit,
        ),
    ]
}

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
}


# The tools that change a file: what edit classifiers (rewards, monitors, feedback) count as an edit.
EDIT_TOOLS = ("edit_file", "replace_lines", "write_file")


# Tools offered only when a config asks for them (``AgentConfig.<name>_tool``).
OPTIONAL_TOOLS = ("lint",)


def offered(cfg: AgentConfig | None = None) -> list[str]:
    """The names of the tools an agent with ``cfg`` is given: every tool that edits no file, and
    the edit tools ``cfg.edit_tools`` names, and ``lint`` where ``cfg.lint_tool``; always in
    ``TOOLS`` order (prefix caches depend on it)."""
    cfg = cfg or AgentConfig()
    return [name for name in TOOLS
            if (name not in EDIT_TOOLS or name in cfg.edit_tools)
            and (name not in OPTIONAL_TOOLS or getattr(cfg, f"{name}_tool"))]


def tool_schemas(cfg: AgentConfig | None = None) -> list[dict[str, Any]]:
    """The schemas a policy is given under ``cfg`` (default: ``AgentConfig()``), in a fixed order."""
    return [TOOLS[name].schema for name in offered(cfg)]


def _json_type(v: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if v is None else names.get(type(v), type(v).__name__)


_FROM_TEXT: dict[str, Callable[[str], Any]] = {
    "integer": int,
    "number": float,
    "boolean": lambda v: {"true": True, "false": False}[v],
}


def typed_args(tool: Tool, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with the text values (``codec.TextValue``: the ``xml`` tool syntax writes every
    value as text) of integer, number and boolean parameters converted: ``"12"`` -> 12. Text
    that is not such a value, and any JSON string, stays as it is, for ``check_args`` to refuse."""
    props = tool.parameters["properties"]
    out = dict(args)
    for name, value in args.items():
        convert = _FROM_TEXT.get(props.get(name, {}).get("type", ""))
        if convert and isinstance(value, TextValue):
            try:
                out[name] = convert(value.strip())
            except (ValueError, KeyError):
                pass
    return out


def check_args(tool: Tool, args: dict[str, Any]) -> str | None:
    """Why ``args`` do not fit the tool's schema, or None. Optional arguments may be null."""
    props, required = tool.parameters["properties"], tool.parameters["required"]
    for name in args:
        if name not in props:
            return f"unknown argument '{name}' for {tool.name}; it takes: {', '.join(props)}"
    for name in required:
        if args.get(name) is None:
            return f"missing required argument '{name}' ({props[name]['type']}) for {tool.name}"
    for name, value in args.items():
        want = props[name]["type"]
        if value is not None and not _JSON_TYPES[want](value):
            shown = repr(value) if len(repr(value)) < 60 else repr(value)[:57] + "..."
            return f"argument '{name}' of {tool.name} must be of type {want}, got {_json_type(value)} {shown}"
    return None


def workspace_path(sandbox: Sandbox, path: str) -> str:
    """Normalise a workspace-relative path; PathEscape for anything that leaves the workspace.

    The sandbox checks too (symlinks included); this lexical check also covers the tools
    that only pass paths to commands, and gives the model a clear message.
    """
    if "\0" in path:
        raise ToolError("path contains a NUL byte")
    p = path.strip() or "."
    if p.startswith("/"):
        root = sandbox.workdir.rstrip("/")
        if p != root and not p.startswith(root + "/"):
            raise PathEscape(f"path '{path}' is outside the workspace; use paths relative to the workspace root")
        p = p[len(root) + 1 :] or "."
    norm = posixpath.normpath(p)
    if norm == ".." or norm.startswith("../"):
        raise PathEscape(f"path '{path}' is outside the workspace; use paths relative to the workspace root")
    return norm


def _invalid(message: str, started: float, cfg: AgentConfig) -> ToolOutcome:
    hint = f"\nAvailable tools: {', '.join(offered(cfg))}."
    return ToolOutcome(f"Error: {message}.{hint}", ok=False, invalid=True, seconds=time.monotonic() - started)


def execute(sandbox: Sandbox, call: ToolCall, cfg: AgentConfig) -> ToolOutcome:
    """Run one tool call. Never raises, except ``Submitted`` from the submit tool."""
    started = time.monotonic()
    if call.error:
        return _invalid(f"could not read your tool call: {call.error}", started, cfg)
    tool = TOOLS.get(call.name) if call.name in offered(cfg) else None
    if tool is None:
        return _invalid(f"unknown tool '{call.name}'", started, cfg)
    typed = typed_args(tool, call.arguments)
    problem = check_args(tool, typed)
    if problem:
        return _invalid(problem, started, cfg)
    args = {k: v for k, v in typed.items() if v is not None}
    try:
        if "path" in args:
            args["path"] = workspace_path(sandbox, args["path"])
        observation, ok = tool.fn(sandbox, args, cfg), True
    except Submitted:
        raise
    except (ToolError, PathEscape) as e:
        observation, ok = f"Error: {e}", False
    except Exception as e:  # a tool bug or a sandbox failure must not end the episode silently
        observation, ok = f"Error: {tool.name} failed: {type(e).__name__}: {e}", False
    return ToolOutcome(observation, ok=ok, seconds=time.monotonic() - started)
