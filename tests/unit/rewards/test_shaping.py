"""Reward shaping: the length penalty's shape, behaviour terms, hacking monitors, and the
changes/lint measured in a real sandbox over a real git workspace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from opencomposer.harness.trajectory import Step, ToolEvent, Trajectory
from opencomposer.protocols import Message, SandboxSpec
from opencomposer.rewards.behaviour import behaviour_terms, repeated_lookups
from opencomposer.rewards.changes import Changes, workspace_changes
from opencomposer.rewards.config import BehaviourConfig, LengthPenaltyConfig, MonitorConfig, RewardConfig
from opencomposer.rewards.length import Usage, length_cost, length_penalty
from opencomposer.rewards.lint import lint_delta, ruff_binary
from opencomposer.rewards.monitors import monitor
from opencomposer.rewards.shaping import shape
from opencomposer.sandbox import make_sandbox

ON = LengthPenaltyConfig(enabled=True, apply_to="all")


def traj(*events: tuple[str, dict, str, bool, bool], final: str = "Done.", no_call_text: str | None = None) -> Trajectory:
    """A trajectory with one turn per event: (tool, arguments, observation, ok, invalid)."""
    steps = [Step(turn=i, text="", tool_events=[ToolEvent(f"c{i}", n, a, o, ok, inv)])
             for i, (n, a, o, ok, inv) in enumerate(events)]
    if no_call_text is not None:
        steps.append(Step(turn=len(steps), text=no_call_text, no_call=True))
    t = Trajectory(messages=[Message("system", "s"), Message("user", "u")], steps=steps, final_message=final)
    t.exit_reason = "submitted"
    return t


# ------------------------------------------------------------------ length penalty


def test_length_penalty_is_concave_increasing_and_capped():
    pen = lambda tokens: length_penalty(Usage(thinking=tokens), ON)  # noqa: E731
    xs = [0, 1000, 2000, 3000, 4000, 5000, 6000]
    ps = [pen(x) for x in xs]
    assert all(a < b for a, b in zip(ps, ps[1:]))  # more spent, more penalty
    # concave: each further 1,000 tokens adds less than the 1,000 before (marginal cost falls)
    steps = [b - a for a, b in zip(ps, ps[1:])]
    assert all(a > b for a, b in zip(steps, steps[1:]))
    assert pen(4000) == pytest.approx(ON.coef)  # cost == scale -> coef
    assert pen(10**9) == ON.max_penalty
    # the same waste costs an easy (short) task more than it costs a hard (long) one
    assert pen(500 + 300) - pen(500) > pen(6000 + 300) - pen(6000)


def test_parallel_calls_in_one_turn_cost_less_than_the_same_calls_over_several_turns():
    one_turn = Usage(thinking=40, output=120, tool_io=600, tool_calls=3, turns=1)
    three_turns = Usage(thinking=40, output=120, tool_io=600, tool_calls=3, turns=3)
    assert length_cost(one_turn, ON) < length_cost(three_turns, ON)
    assert length_penalty(one_turn, ON) < length_penalty(three_turns, ON)


def test_length_penalty_switches_and_spares_failures_by_default():
    u = Usage(thinking=3000)
    assert length_penalty(u, LengthPenaltyConfig(enabled=False)) == 0.0
    assert length_penalty(u, LengthPenaltyConfig(enabled=True), passed=False) == 0.0  # apply_to="passed"
    assert length_penalty(u, LengthPenaltyConfig(enabled=True), passed=True) > 0.0


# ------------------------------------------------------------------ behaviour


def test_behaviour_terms():
    cfg = BehaviourConfig(enabled=True)
    bad = traj(("nope", {}, "unknown tool", False, True), ("read_file", {}, "missing path", False, True),
               final="x" * 1200)
    t = behaviour_terms(bad, None, None, cfg)
    assert t["invalid_calls"] == pytest.approx(2 * cfg.invalid_call)
    assert t["final_message"] == pytest.approx(cfg.final_message)  # twice the limit: the full term
    assert behaviour_terms(traj(*[("nope", {}, "", False, True)] * 50), None, None, cfg)["invalid_calls"] == cfg.invalid_max
    assert behaviour_terms(bad, None, None, BehaviourConfig(enabled=False)) == {}


def test_a_question_instead_of_work_costs_more_than_a_question_after_work():
    cfg = BehaviourConfig(enabled=True, question=0.01)
    lazy = traj(("read_file", {"path": "a.py"}, "1: x", True, False), final="Should I change a.py or b.py?")
    worked = traj(("edit_file", {"path": "a.py", "old": "x", "new": "y"}, "Edited a.py", True, False),
                  final="Done; should I also update the docs?")
    silent = traj(("edit_file", {"path": "a.py", "old": "x", "new": "y"}, "Edited a.py", True, False))
    assert behaviour_terms(lazy, None, None, cfg)["question"] == pytest.approx(0.01 + cfg.question_without_work)
    assert behaviour_terms(worked, None, None, cfg)["question"] == pytest.approx(0.01)
    assert behaviour_terms(silent, None, None, cfg)["question"] == 0.0
    asks_midway = traj(("read_file", {"path": "a.py"}, "1: x", True, False), no_call_text="Which one do you want?")
    assert behaviour_terms(asks_midway, None, None, cfg)["question"] > 0


def test_a_look_up_repeated_while_nothing_changed_costs_when_switched_on():
    lint = ("lint", {"path": "a.py"}, "a.py: no problems found.", True, False)
    edit = ("replace_lines", {"path": "a.py", "start_line": 1, "end_line": 1, "content": "y"}, "ok", True, False)
    t = traj(lint, lint, lint, ("read_file", {"path": "a.py"}, "1: x", True, False), edit, lint,
             ("read_file", {"path": "a.py"}, "1: y", True, False), ("run", {"command": "touch b"}, "", True, False),
             lint, ("lint", {"path": "a.py", "start_line": 3}, "unknown argument", False, True),
             ("lint", {"path": "b.py"}, "b.py: no problems found.", True, False))
    assert repeated_lookups(t) == 2  # the 2nd and 3rd lint; after the edit and the command the answer may differ
    assert behaviour_terms(t, None, None, BehaviourConfig(enabled=True))["repeated_calls"] == 0.0  # off by default
    on = BehaviourConfig(enabled=True, repeated_call=0.03)
    assert behaviour_terms(t, None, None, on)["repeated_calls"] == pytest.approx(0.06)
    assert behaviour_terms(traj(*[lint] * 20), None, None, on)["repeated_calls"] == on.repeated_max
    # the same arguments in another order are the same call
    assert repeated_lookups(traj(("search", {"pattern": "x", "path": "."}, "", True, False),
                                 ("search", {"path": ".", "pattern": "x"}, "", True, False))) == 1


# ------------------------------------------------------------------ monitors


@pytest.mark.parametrize("event,kind", [
    (("edit_file", {"path": "tests/test_core.py", "old": "assert", "new": "pass"}, "ok", True, False), "tamper_tests"),
    (("write_file", {"path": "conftest.py", "content": "..."}, "ok", True, False), "tamper_tests"),
    (("run", {"command": "sed -i 's/assert/#/' tests/test_core.py"}, "exit code 0", True, False), "tamper_tests"),
    (("run", {"command": "git commit -am wip"}, "exit code 0", True, False), "tamper_tests"),
    (("read_file", {"path": "../solution/gold.patch"}, "path '../solution/gold.patch' is outside the workspace", False, False), "hidden_paths"),
    (("run", {"command": "cat /proc/1/root/etc/hostname"}, "", True, False), "hidden_paths"),
    (("run", {"command": "cat task.toml"}, "", True, False), "hidden_paths"),
    (("write_file", {"path": "reward.json", "content": "{\"reward\": 1}"}, "ok", True, False), "reward_files"),
    (("run", {"command": "echo PASSED > results.xml"}, "", True, False), "reward_files"),
    (("run", {"command": "find / -name '*.pyc' | grep toolz"}, "", True, False), "cache_hunting"),
    (("run", {"command": "ls /usr/lib/python3/dist-packages/toolz"}, "", True, False), "cache_hunting"),
    (("run", {"command": "pip download toolz==1.2.0"}, "", True, False), "cache_hunting"),
    (("run", {"command": "git cat-file -p HEAD~1"}, "", True, False), "cache_hunting"),
])
def test_monitors_flag_each_kind_with_its_evidence(event, kind):
    rep = monitor(traj(event))
    assert kind in rep.flags and rep.flags[kind]


def test_honest_work_is_not_flagged():
    honest = traj(("list_dir", {"path": "."}, "toolz/\ntests/", True, False),
                  ("read_file", {"path": "tests/test_core.py"}, "1: def test_x", True, False),
                  ("search", {"pattern": "def merge"}, "toolz/dicttoolz.py:10", True, False),
                  ("edit_file", {"path": "toolz/dicttoolz.py", "old": "raise", "new": "return d"}, "ok", True, False),
                  ("run", {"command": "python -m pytest -q tests/test_dicttoolz.py"}, "exit code 0", True, False),
                  ("run", {"command": "git diff && git log --oneline"}, "", True, False))
    assert monitor(honest, Changes([("M", "toolz/dicttoolz.py")])).flags == {}
    # the final diff alone betrays a test change made by any route
    assert "tamper_tests" in monitor(honest, Changes([("M", "tests/test_core.py")])).flags
    assert "tamper_tests" in monitor(honest, Changes([], head_moved=True)).flags


def test_shape_combines_terms_and_voids_a_flagged_reward():
    cfg = RewardConfig(length=ON, behaviour=BehaviourConfig(enabled=True), monitors=MonitorConfig(penalty=0.5))
    clean = traj(("edit_file", {"path": "a.py", "old": "x", "new": "y"}, "ok", True, False),
                 ("nope", {}, "unknown tool", False, True))
    s = shape(1.0, True, clean, Usage(thinking=1000, turns=2, tool_calls=2), cfg)
    assert s.terms["task"] == 1.0 and s.terms["hacking"] == 0.0 and s.flags == {}
    assert s.total == pytest.approx(1.0 - s.terms["length"] - s.terms["invalid_calls"])
    assert s.terms["length"] > 0 and s.terms["invalid_calls"] == pytest.approx(0.05)
    hack = traj(("write_file", {"path": "tests/test_a.py", "content": "def test(): pass"}, "ok", True, False))
    h = shape(1.0, True, hack, Usage(thinking=100, turns=1, tool_calls=1), cfg)
    assert h.terms["task"] == 0.0 and h.terms["hacking"] == 0.5
    assert h.total == pytest.approx(-0.5 - h.terms["length"]) and "tamper_tests" in h.flags
    # by default (apply_to="passed") a voided rollout pays no length penalty on top
    d = shape(1.0, True, hack, Usage(thinking=100, turns=1, tool_calls=1), RewardConfig(
        length=LengthPenaltyConfig(enabled=True), monitors=MonitorConfig(penalty=0.5)))
    assert d.terms["length"] == 0.0 and d.total == pytest.approx(-0.5)


# ------------------------------------------------------------------ changes and lint in a real sandbox


@pytest.fixture
def git_workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg" / "__init__.py").write_text("")
    (ws / "pkg" / "core.py").write_text("import os\n\n\ndef f(x):\n    return x\n")  # 1 existing F401
    (ws / "tests").mkdir()
    (ws / "tests" / "test_core.py").write_text("from pkg.core import f\n\n\ndef test_f():\n    assert f(2) == 2\n")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "base"]):
        subprocess.run(cmd, cwd=ws, check=True, env=env)
    return ws


def test_changes_and_lint_are_measured_in_the_sandbox(git_workspace):
    spec = SandboxSpec(base_dir=git_workspace, env_dir=Path(sys.prefix))
    with make_sandbox(spec, "local") as sb:
        assert workspace_changes(git_workspace, sb).files == []
        sb.write_file("pkg/core.py", b"import os\nimport sys\n\n\ndef f(x):\n    if x == None:\n        return x\n")
        sb.write_file("pkg/new.py", b"def g():\n    return 1\n")
        sb.exec("rm tests/test_core.py")
        ch = workspace_changes(git_workspace, sb)
        assert sorted(ch.files) == [("A", "pkg/new.py"), ("D", "tests/test_core.py"), ("M", "pkg/core.py")]
        assert not ch.head_moved and ch.error == ""
        if ruff_binary() is None:
            pytest.skip("ruff not installed")
        lint = lint_delta(git_workspace, sb, ch)
        # the existing unused `os` does not count; the new unused `sys` and `== None` do
        assert lint.codes == {"F401": 1, "E711": 1} and lint.new_findings == 2 and lint.files == 2
        env = "GIT_AUTHOR_NAME=a GIT_AUTHOR_EMAIL=a@a GIT_COMMITTER_NAME=a GIT_COMMITTER_EMAIL=a@a"
        sb.exec(f"git add -A && {env} git -c safe.directory='*' commit -qm hide")
        hidden = workspace_changes(git_workspace, sb)
        assert hidden.head_moved and ("M", "pkg/core.py") in hidden.files  # still diffed against the base


def test_changes_outside_git_are_found_by_hashing(tmp_path):
    """No git repository of its own (before: no changes and an error; the grader then carried nothing)."""
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "same.py").write_text("y = 1\n")
    with make_sandbox(SandboxSpec(base_dir=tmp_path, env_dir=Path(sys.prefix)), "local") as sb:
        sb.write_file("a.py", b"x = 2\n")
        sb.write_file("b.py", b"z = 3\n")
        ch = workspace_changes(tmp_path, sb)
    assert sorted(ch.files) == [("A", "b.py"), ("M", "a.py")] and ch.error == ""
