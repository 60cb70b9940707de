"""AgentConfig.edit_check: an edit that would leave a Python file unparseable is refused (the
file unchanged, the answer naming the line and the error) or made with a warning; files that did
not parse before, and other files, are left to the agent. Against a real local sandbox."""

from __future__ import annotations

import pytest

from opencomposer.harness.fs_tools import parse_problem
from opencomposer.harness.tools import execute
from opencomposer.protocols import ToolCall

from testkit.agent_repo import CALC

ALL_EDITS = ["edit_file", "replace_lines", "write_file"]


def call(sandbox, cfg, name, **args):
    return execute(sandbox, ToolCall(name, args), cfg)


def core(sandbox) -> str:
    return sandbox.read_file("calc/core.py").decode()


def checked(cfg, mode):
    return cfg.model_copy(update={"edit_tools": ALL_EDITS, "edit_check": mode})


# an insert at an impossible indent, as the 135M agent wrote 19 of its 77 failed edits (session 32)
BAD_INSERT = dict(path="calc/core.py", start_line=14, end_line=13, new="        result = 0")


def test_refuse_leaves_the_file_unchanged_and_names_the_line_and_error(sandbox, cfg):
    out = call(sandbox, checked(cfg, "refuse"), "replace_lines", **BAD_INSERT)
    assert not out.ok and not out.invalid  # a tool error the agent can act on, not a malformed call
    assert core(sandbox) == CALC
    assert "edit refused: calc/core.py would no longer parse as Python (line 14: unexpected indent: " \
           "`result = 0`); file unchanged" in out.observation


def test_refuse_covers_edit_file_and_write_file(sandbox, cfg):
    c = checked(cfg, "refuse")
    out = call(sandbox, c, "edit_file", path="calc/core.py", old="    return a - b\n", new="    return a -\n")
    assert not out.ok and "line 9: invalid syntax" in out.observation and core(sandbox) == CALC
    out = call(sandbox, c, "write_file", path="calc/core.py", content="def f(:\n    pass\n")
    assert not out.ok and "would no longer parse" in out.observation and core(sandbox) == CALC
    out = call(sandbox, c, "write_file", path="calc/new.py", content="def f(:\n")  # a new file: refused too
    assert not out.ok and "calc/new.py would no longer parse" in out.observation
    with pytest.raises(FileNotFoundError):
        sandbox.read_file("calc/new.py")


def test_an_edit_that_parses_is_made_as_without_the_check(sandbox, cfg):
    good = dict(path="calc/core.py", start_line=14, end_line=13, new="    result = 0")
    out = call(sandbox, checked(cfg, "refuse"), "replace_lines", **good)
    after = core(sandbox)
    sandbox.write_file("calc/core.py", CALC.encode())
    plain = call(sandbox, checked(cfg, "off"), "replace_lines", **good)
    assert out.ok and out.observation == plain.observation and after == core(sandbox) != CALC


def test_warn_makes_the_edit_and_says_where_the_file_stops_parsing(sandbox, cfg):
    out = call(sandbox, checked(cfg, "warn"), "replace_lines", **BAD_INSERT)
    assert out.ok
    assert core(sandbox).split("\n")[13] == "        result = 0"
    assert out.observation.endswith("\nWarning: calc/core.py no longer parses as Python "
                                    "(line 14: unexpected indent: `result = 0`).")


def test_off_is_the_default_and_a_broken_edit_goes_through(sandbox, cfg):
    assert cfg.edit_check == "off"
    out = call(sandbox, cfg.model_copy(update={"edit_tools": ALL_EDITS}), "replace_lines", **BAD_INSERT)
    assert out.ok and "parse" not in out.observation


def test_a_file_that_did_not_parse_before_and_other_files_are_not_checked(sandbox, cfg):
    c = checked(cfg, "refuse")
    sandbox.write_file("calc/core.py", (CALC + "def broken(:\n").encode())
    out = call(sandbox, c, "replace_lines", path="calc/core.py", start_line=5, end_line=5, new="    return (a +")
    assert out.ok  # it did not parse before: not this edit's doing
    out = call(sandbox, c, "write_file", path="notes.txt", content="def f(:\n")
    assert out.ok


def test_parse_problem_reads_indentation_and_syntax_errors():
    assert parse_problem("m.py", "x = 1\n") is None
    assert parse_problem("m.py", "if x:\nreturn\n") == "line 2: expected an indented block after 'if' statement " \
                                                      "on line 1: `return`"
    assert parse_problem("m.py", "x = (1,\n").startswith("line 1: '(' was never closed")
