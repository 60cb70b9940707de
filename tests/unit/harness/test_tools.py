"""Every tool against a real local sandbox: happy paths, refusals, caps and timeouts."""

from __future__ import annotations

import time

import pytest

from opencomposer.harness.tools import Submitted, execute, offered, tool_schemas
from opencomposer.models.codec import parse_tool_calls
from opencomposer.protocols import ToolCall

from testkit.agent_repo import CALC, open_sandbox


@pytest.fixture(params=["local", pytest.param("namespace", marks=pytest.mark.namespace)])
def sandbox(request, repo):
    """The tools must behave the same in every backend the agent is deployed in."""
    with open_sandbox(repo, request.param) as sb:
        yield sb


def call(sandbox, cfg, name, **args):
    return execute(sandbox, ToolCall(name, args), cfg)


def test_schemas_are_openai_function_schemas():
    names = [s["function"]["name"] for s in tool_schemas()]
    assert names == ["read_file", "list_dir", "search", "edit_file", "write_file", "run", "submit"]
    for s in tool_schemas():
        assert s["type"] == "function"
        params = s["function"]["parameters"]
        assert params["type"] == "object" and set(params["required"]) <= set(params["properties"])
        assert s["function"]["description"]


def test_text_values_of_typed_parameters_are_converted_as_the_xml_syntax_writes_them(sandbox, cfg):
    def xml(**args):
        text = "\n".join(f"<parameter={k}>\n{v}\n</parameter>" for k, v in args.items())
        [c] = parse_tool_calls(f"<tool_call>\n<function=read_file>\n{text}\n</function>\n</tool_call>")[1]
        return execute(sandbox, c, cfg)

    out = xml(path="calc/core.py", start_line="2", end_line=" 3")
    assert out.ok and out.observation.split("\n")[0].lstrip().startswith("2")
    bad = xml(path="calc/core.py", start_line="two")
    assert not bad.ok and "start_line" in bad.observation and "integer" in bad.observation


# ---------------------------------------------------------------- read_file


def test_read_file_numbers_lines_and_reads_ranges(sandbox, cfg):
    out = call(sandbox, cfg, "read_file", path="calc/core.py")
    assert out.ok and out.observation.splitlines()[3] == "     4\tdef add(a, b):"
    part = call(sandbox, cfg, "read_file", path="calc/core.py", start_line=4, end_line=5).observation
    assert part.splitlines() == ["     4\tdef add(a, b):", "     5\t    return a + b", "[lines 4-5 of 16]"]


def test_read_file_caps_long_files_and_says_how_to_go_on(sandbox, cfg):
    sandbox.write_file("big.txt", "".join(f"line {i}\n" for i in range(1, 2001)).encode())
    obs = call(sandbox, cfg, "read_file", path="big.txt").observation
    assert len(obs) <= cfg.max_output_chars
    last_row = [l for l in obs.splitlines() if "\t" in l][-1]
    shown = int(last_row.split("\t")[0])
    assert f"start_line={shown + 1} to read further" in obs
    nxt = call(sandbox, cfg, "read_file", path="big.txt", start_line=shown + 1).observation
    assert nxt.startswith(f"{shown + 1:>6}\tline {shown + 1}")


def test_read_file_errors(sandbox, cfg):
    missing = call(sandbox, cfg, "read_file", path="nope.py")
    assert not missing.ok and not missing.invalid and "no such file" in missing.observation
    assert "is a directory" in call(sandbox, cfg, "read_file", path="calc").observation
    assert "past the end" in call(sandbox, cfg, "read_file", path="calc/core.py", start_line=99).observation
    sandbox.write_file("blob.bin", b"\x00\x01\x02")
    assert "binary" in call(sandbox, cfg, "read_file", path="blob.bin").observation


@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "calc/../../x", ".."])
def test_paths_outside_the_workspace_are_refused(sandbox, cfg, path):
    for name, args in [
        ("read_file", {"path": path}),
        ("write_file", {"path": path, "content": "x"}),
        ("edit_file", {"path": path, "old": "a", "new": "b"}),
        ("list_dir", {"path": path}),
        ("search", {"pattern": "root", "path": path}),
    ]:
        out = call(sandbox, cfg, name, **args)
        assert not out.ok and "outside the workspace" in out.observation, (name, out.observation)


def test_absolute_path_inside_the_workspace_is_accepted(sandbox, cfg):
    out = call(sandbox, cfg, "read_file", path=f"{sandbox.workdir}/README.md")
    assert out.ok and "# calc" in out.observation


def test_symlink_out_of_the_workspace_is_refused(sandbox, cfg):
    sandbox.exec(["ln", "-s", "/etc", "etc_link"])
    out = call(sandbox, cfg, "read_file", path="etc_link/passwd")
    assert not out.ok and "outside the workspace" in out.observation


# ---------------------------------------------------------------- list_dir and search


def test_list_dir_skips_git_and_marks_directories(sandbox, cfg):
    obs = call(sandbox, cfg, "list_dir").observation
    assert obs.splitlines() == ["README.md", "calc/", "calc/__init__.py", "calc/core.py"]
    assert call(sandbox, cfg, "list_dir", path="calc", depth=1).observation.splitlines() == [
        "calc/__init__.py", "calc/core.py"
    ]
    assert "no such directory" in call(sandbox, cfg, "list_dir", path="nope").observation
    assert "between 1 and 5" in call(sandbox, cfg, "list_dir", depth=9).observation


def test_list_dir_caps_huge_listings(sandbox, cfg):
    sandbox.exec("mkdir many && cd many && seq 1 600 | sed s/^/file_/ | xargs touch")
    obs = call(sandbox, cfg, "list_dir", path="many").observation
    assert len(obs) <= cfg.max_output_chars
    assert "more entries not shown" in obs


def test_search_reports_file_line_text_and_caps(sandbox, cfg):
    obs = call(sandbox, cfg, "search", pattern=r"def \w+\(").observation
    assert "calc/core.py:4:def add(a, b):" in obs.splitlines()
    many = call(sandbox, cfg, "search", pattern="a", path="calc").observation
    rows = [l for l in many.splitlines() if not l.startswith("[")]
    assert len(rows) == cfg.search_max_results
    assert "more matches not shown" in many


def test_search_in_one_file_still_names_the_file(sandbox, cfg):
    assert call(sandbox, cfg, "search", pattern="def add", path="calc/core.py").observation == "calc/core.py:4:def add(a, b):"


def test_search_glob_no_match_and_bad_regex(sandbox, cfg):
    assert call(sandbox, cfg, "search", pattern="calc", glob="*.md").observation == "README.md:1:# calc"
    assert call(sandbox, cfg, "search", pattern="zzz_nothing").observation.startswith("No matches")
    bad = call(sandbox, cfg, "search", pattern="(unclosed")
    assert not bad.ok and "search failed" in bad.observation
    assert "HEAD" not in call(sandbox, cfg, "search", pattern="refs").observation  # .git skipped


def test_search_pattern_starting_with_dash_is_not_an_option(sandbox, cfg):
    sandbox.write_file("flags.txt", b"use --verbose here\n")
    assert "flags.txt:1:" in call(sandbox, cfg, "search", pattern="--verbose").observation


# ---------------------------------------------------------------- edit_file and write_file


def test_edit_file_replaces_one_exact_occurrence(sandbox, cfg):
    out = call(sandbox, cfg, "edit_file", path="calc/core.py", old="    return a - b\n", new="    return a - b  # sub\n")
    assert out.ok and "Edited calc/core.py" in out.observation and "# sub" in out.observation
    assert sandbox.read_file("calc/core.py").decode() == CALC.replace("a - b\n", "a - b  # sub\n")


def test_ambiguous_edit_leaves_the_file_unchanged(sandbox, cfg):
    out = call(sandbox, cfg, "edit_file", path="calc/core.py", old="    return ", new="    yield ")
    assert not out.ok and not out.invalid
    assert "occurs 3 times" in out.observation and "more surrounding lines" in out.observation
    assert sandbox.read_file("calc/core.py").decode() == CALC


def test_missing_edit_leaves_the_file_unchanged(sandbox, cfg):
    out = call(sandbox, cfg, "edit_file", path="calc/core.py", old="return a * b", new="x")
    assert not out.ok and "not found" in out.observation
    hint = call(sandbox, cfg, "edit_file", path="calc/core.py", old="return a + b   ", new="x").observation
    assert "different leading/trailing whitespace" in hint
    assert "empty" in call(sandbox, cfg, "edit_file", path="calc/core.py", old="", new="x").observation
    assert sandbox.read_file("calc/core.py").decode() == CALC


def test_write_file_creates_parents_and_overwrites(sandbox, cfg):
    assert call(sandbox, cfg, "write_file", path="a/b/c.txt", content="one\ntwo\n").ok
    assert sandbox.read_file("a/b/c.txt") == b"one\ntwo\n"
    call(sandbox, cfg, "write_file", path="a/b/c.txt", content="x")
    assert sandbox.read_file("a/b/c.txt") == b"x"


# ---------------------------------------------------------------- run and submit


def test_run_shows_exit_code_and_output(sandbox, cfg):
    obs = call(sandbox, cfg, "run", command="echo hello; echo oops >&2; exit 3").observation
    assert obs.startswith("exit code 3") and "hello" in obs and "oops" in obs
    assert "calc" in call(sandbox, cfg, "run", command="python -c 'import calc; print(calc.__name__)'").observation


def test_a_command_that_never_ends_is_cut_by_the_timeout(sandbox, cfg):
    t0 = time.monotonic()
    obs = call(sandbox, cfg, "run", command="sleep 1000", timeout=1).observation
    assert time.monotonic() - t0 < 10
    assert obs.startswith("timed out after 1s")


def test_run_timeout_is_capped_by_the_config(sandbox, cfg):
    cfg = cfg.model_copy(update={"command_timeout": 1.0})
    obs = call(sandbox, cfg, "run", command="sleep 1000", timeout=500).observation
    assert "timed out after 1s" in obs and "timeout capped at 1s" in obs


def test_huge_output_is_capped_with_a_notice(sandbox, cfg):
    obs = call(sandbox, cfg, "run", command="seq 1 1000000").observation
    assert len(obs) < cfg.max_output_chars + 500
    assert "cut" in obs and "redirect it to a file" in obs
    assert "1000000" in obs  # the tail survives: test summaries live there


def test_submit_raises_submitted(sandbox, cfg):
    with pytest.raises(Submitted) as e:
        call(sandbox, cfg, "submit", message="all done")
    assert e.value.message == "all done"


# ---------------------------------------------------------------- invalid calls


@pytest.mark.parametrize(
    "tool_call, expected",
    [
        (ToolCall("frob", {}), "unknown tool 'frob'"),
        (ToolCall("read_file", {}), "missing required argument 'path' (string)"),
        (ToolCall("read_file", {"path": 3}), "argument 'path' of read_file must be of type string, got integer"),
        (ToolCall("read_file", {"path": "x", "start_line": "2"}), "must be of type integer, got string"),
        (ToolCall("run", {"command": "ls", "timeout": True}), "must be of type number, got boolean"),
        (ToolCall("read_file", {"path": "x", "mode": "r"}), "unknown argument 'mode'"),
        (ToolCall("", {}, raw="{oops", error="malformed JSON in <tool_call>"), "could not read your tool call"),
    ],
)
def test_invalid_calls_name_the_problem_and_list_the_tools(sandbox, cfg, tool_call, expected):
    out = execute(sandbox, tool_call, cfg)
    assert out.invalid and not out.ok
    assert expected in out.observation
    assert "Available tools: " + ", ".join(offered(cfg)) + "." in out.observation


def test_null_optional_arguments_are_treated_as_absent(sandbox, cfg):
    out = call(sandbox, cfg, "read_file", path="README.md", start_line=None)
    assert out.ok and "# calc" in out.observation
