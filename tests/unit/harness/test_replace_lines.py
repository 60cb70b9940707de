"""replace_lines (edit by the numbers read_file shows) and AgentConfig.edit_tools (which edit
tools the agent is offered), against a real local sandbox."""

from __future__ import annotations

import pytest

from opencomposer.config import AgentConfig, AgentRunConfig, ConfigError, validate
from opencomposer.harness.prompt import SYSTEM_PROMPT, agent_tools, no_call_nudge, system_prompt
from opencomposer.harness.tools import execute, offered, tool_schemas
from opencomposer.models.codec import format_tool_call, parse_tool_calls, tools_system_prompt
from opencomposer.protocols import ToolCall

from testkit.agent_repo import CALC

LINES = ["replace_lines", "write_file"]


@pytest.fixture
def lines_cfg(cfg) -> AgentConfig:
    return cfg.model_copy(update={"edit_tools": LINES})


def call(sandbox, cfg, name, **args):
    return execute(sandbox, ToolCall(name, args), cfg)


def core(sandbox) -> str:
    return sandbox.read_file("calc/core.py").decode()


# ---------------------------------------------------------------- the tool


def test_replace_lines_replaces_the_numbered_lines_and_shows_them(sandbox, lines_cfg):
    out = call(sandbox, lines_cfg, "replace_lines", path="calc/core.py", start_line=5, end_line=5,
               new="    total = a + b\n    return total")  # no final newline: whole lines all the same
    assert out.ok, out.observation
    assert core(sandbox) == CALC.replace("    return a + b\n", "    total = a + b\n    return total\n")
    head, *rows = out.observation.splitlines()
    assert head == ("Edited calc/core.py: replaced lines 5-5 (1 line(s)) with 2 line(s); it now has 17 lines. "
                    "Lines after the edit moved by +1.")
    assert "     5\t    total = a + b" in rows and "     6\t    return total" in rows
    assert rows[0].startswith("     2\t")  # the edited region with its neighbours, numbered as read_file does


def test_replace_lines_inserts_before_start_line_and_at_the_end(sandbox, lines_cfg):
    out = call(sandbox, lines_cfg, "replace_lines", path="calc/core.py", start_line=4, end_line=3,
               new="@staticmethod\n")
    assert out.ok and "inserted 1 line(s) before line 4" in out.observation
    assert core(sandbox) == CALC.replace("def add", "@staticmethod\ndef add")
    out = call(sandbox, lines_cfg, "replace_lines", path="calc/core.py", start_line=18, end_line=17, new="# end")
    assert out.ok and core(sandbox).endswith("    return result\n# end\n")


def test_replace_lines_deletes_with_empty_new_and_keeps_a_missing_final_newline(sandbox, lines_cfg):
    out = call(sandbox, lines_cfg, "replace_lines", path="calc/core.py", start_line=8, end_line=10, new="")
    assert out.ok and "deleted lines 8-10" in out.observation and "moved by -3" in out.observation
    assert core(sandbox) == CALC.replace("def sub(a, b):\n    return a - b\n\n", "")
    sandbox.write_file("x.txt", b"one\ntwo")
    assert call(sandbox, lines_cfg, "replace_lines", path="x.txt", start_line=2, end_line=2, new="TWO\n").ok
    assert sandbox.read_file("x.txt") == b"one\nTWO"


@pytest.mark.parametrize("start, end, expected", [
    (0, 1, "start_line 0 is out of range: calc/core.py has 16 lines, so start_line must be 1 to 17"),
    (18, 18, "start_line 18 is out of range: calc/core.py has 16 lines"),
    (5, 17, "end_line 17 is past the end: calc/core.py has 16 lines"),
    (5, 3, "end_line 3 is before start_line 5"),
])
def test_out_of_range_lines_name_the_argument_and_the_line_count(sandbox, lines_cfg, start, end, expected):
    out = call(sandbox, lines_cfg, "replace_lines", path="calc/core.py", start_line=start, end_line=end, new="x\n")
    assert not out.ok and not out.invalid and expected in out.observation and "file unchanged" in out.observation
    assert core(sandbox) == CALC


def test_an_edit_that_changes_nothing_and_a_missing_file_are_errors(sandbox, lines_cfg):
    same = call(sandbox, lines_cfg, "replace_lines", path="calc/core.py", start_line=5, end_line=5,
                new="    return a + b\n")
    assert not same.ok and "nothing would change" in same.observation
    missing = call(sandbox, lines_cfg, "replace_lines", path="nope.py", start_line=1, end_line=0, new="x")
    assert not missing.ok and "no such file: nope.py" in missing.observation


@pytest.mark.parametrize("args, expected", [
    ({"start_line": "five", "end_line": 5, "new": "x"}, "argument 'start_line' of replace_lines must be of type integer"),
    ({"start_line": 5, "end_line": 5.0, "new": "x"}, "argument 'end_line' of replace_lines must be of type integer"),
    ({"start_line": 5, "end_line": 5, "new": 3}, "argument 'new' of replace_lines must be of type string"),
    ({"start_line": 5, "new": "x"}, "missing required argument 'end_line' (integer)"),
])
def test_bad_arguments_are_invalid_calls_naming_the_argument(sandbox, lines_cfg, args, expected):
    out = call(sandbox, lines_cfg, "replace_lines", path="calc/core.py", **args)
    assert out.invalid and expected in out.observation
    assert core(sandbox) == CALC


@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "calc/../../x"])
def test_paths_outside_the_workspace_are_refused(sandbox, lines_cfg, path):
    out = call(sandbox, lines_cfg, "replace_lines", path=path, start_line=1, end_line=1, new="x")
    assert not out.ok and "outside the workspace" in out.observation


@pytest.mark.parametrize("syntax", ["json", "xml"])
def test_both_tool_call_syntaxes_carry_a_replace_lines_call(sandbox, lines_cfg, syntax):
    text = format_tool_call(ToolCall("replace_lines", {"path": "calc/core.py", "start_line": 8, "end_line": 9,
                                                       "new": "def sub(a, b):\n    return b - a\n"}), syntax)
    [c] = parse_tool_calls(text)[1]
    assert c.name == "replace_lines" and not c.error
    out = execute(sandbox, c, lines_cfg)  # the xml syntax's text values "8", "9" become integers
    assert out.ok, out.observation
    assert core(sandbox) == CALC.replace("return a - b", "return b - a")


# ---------------------------------------------------------------- the setting


def test_the_default_offers_todays_tools_and_prompt():
    assert offered() == ["read_file", "list_dir", "search", "edit_file", "write_file", "run", "submit"]
    assert system_prompt(AgentConfig()) == SYSTEM_PROMPT and "Edit with edit_file" in SYSTEM_PROMPT
    assert tool_schemas() == agent_tools(AgentConfig())


def test_offered_tools_alone_are_in_the_prompt(lines_cfg):
    names = [s["function"]["name"] for s in agent_tools(lines_cfg)]
    assert names == ["read_file", "list_dir", "search", "replace_lines", "write_file", "run", "submit"]
    prompt = system_prompt(lines_cfg)
    assert "replace_lines" in prompt and "edit_file" not in prompt
    preamble = tools_system_prompt(agent_tools(lines_cfg))
    assert '"name": "replace_lines"' in preamble and '"name": "edit_file"' not in preamble
    assert "edit_file" not in no_call_nudge(False, lines_cfg) and "replace_lines" in no_call_nudge(False, lines_cfg)
    both = system_prompt(AgentConfig(edit_tools=["edit_file", "replace_lines", "write_file"]))
    assert "Edit with edit_file" in both and "Or edit by line numbers with replace_lines" in both


def test_a_tool_not_offered_is_an_invalid_call(sandbox, cfg, lines_cfg):
    out = call(sandbox, lines_cfg, "edit_file", path="calc/core.py", old="a + b", new="b + a")
    assert out.invalid and "unknown tool 'edit_file'" in out.observation
    assert "Available tools: read_file, list_dir, search, replace_lines, write_file, run, submit." in out.observation
    out = call(sandbox, cfg, "replace_lines", path="calc/core.py", start_line=5, end_line=5, new="x")
    assert out.invalid and "unknown tool 'replace_lines'" in out.observation
    assert core(sandbox) == CALC


@pytest.mark.parametrize("tools, expected", [
    ([], "at least 1 item"),
    (["edit_file", "edit_file"], "names a tool twice"),
    (["patch"], "'edit_file', 'replace_lines' or 'write_file'"),
])
def test_edit_tools_setting_is_checked(tools, expected):
    with pytest.raises(ConfigError, match="agent") as e:
        validate({"agent": {"edit_tools": tools}}, AgentRunConfig, "x.toml")
    assert expected in str(e.value)
    assert validate({"agent": {"edit_tools": LINES}}, AgentRunConfig, "x.toml").agent.edit_tools == LINES
