"""The agent loop with a scripted policy: invalid calls, nudges, limits and the transcript."""

from __future__ import annotations

import json
import time

from opencomposer.harness.loop import Agent, run_episode
from opencomposer.harness.prompt import SYSTEM_PROMPT
from opencomposer.policies.scripted import ScriptedPolicy, tool_call
from opencomposer.harness.tools import offered, tool_schemas
from opencomposer.harness.trajectory import Trajectory
from opencomposer.protocols import ContextLengthError, PolicyOutput, ToolCall

SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {"message": "done"}}\n</tool_call>'


def test_a_clean_episode(sandbox, cfg):
    policy = ScriptedPolicy([
        "Let me look.\n<tool_call>\n{\"name\": \"list_dir\", \"arguments\": {}}\n</tool_call>",
        [tool_call("edit_file", path="calc/core.py", old="return a - b", new="return b - a"),
         tool_call("read_file", path="calc/core.py", start_line=8, end_line=9)],
        SUBMIT,
    ])
    traj = run_episode("Swap sub.", sandbox, policy, cfg, task_id="t1")
    assert traj.exit_reason == "submitted" and traj.final_message == "done"
    assert (traj.turns, traj.tool_calls, traj.invalid_calls, traj.no_call_turns) == (3, 4, 0, 0)
    assert [m.role for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "tool", "assistant", "tool"]
    assert traj.messages[0].content == SYSTEM_PROMPT and traj.messages[1].content == "Swap sub."
    assert traj.messages[2].content == "Let me look."  # the call markup is kept out of the prose
    assert "return b - a" in traj.messages[6].content
    # every tool message answers a call of the assistant message before it, by a unique id
    ids = [c.id for m in traj.messages for c in m.tool_calls]
    assert len(ids) == len(set(ids)) == 4
    assert [m.tool_call_id for m in traj.messages if m.role == "tool"] == ids
    assert policy.tools == tool_schemas()
    assert b"return b - a" in sandbox.read_file("calc/core.py")


def test_invalid_calls_are_answered_counted_and_never_dropped(sandbox, cfg):
    policy = ScriptedPolicy([
        '<tool_call>\n{"name": "read_file", "arguments": {"path": </tool_call>'
        '<tool_call>\n{"name": "open_file", "arguments": {"path": "x"}}\n</tool_call>'
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md", "lines": 3}}\n</tool_call>'
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call>',
        SUBMIT,
    ])
    traj = run_episode("Look around.", sandbox, policy, cfg)
    assert traj.exit_reason == "submitted"
    assert traj.invalid_calls == 3 and traj.tool_calls == 5
    events = traj.steps[0].tool_events
    assert [e.invalid for e in events] == [True, True, True, False]
    assert "malformed JSON" in events[0].observation and events[0].raw
    assert "unknown tool 'open_file'" in events[1].observation
    assert "unknown argument 'lines'" in events[2].observation
    for e in events[:3]:
        assert "Available tools: " + ", ".join(offered(cfg)) + "." in e.observation
    assert "# calc" in events[3].observation
    # the model saw all four answers before its next turn
    assert sum(m.role == "tool" for m in policy.seen[1]) == 4


def test_a_turn_without_calls_gets_a_nudge(sandbox, cfg):
    policy = ScriptedPolicy(["I think I am done.", SUBMIT])
    traj = run_episode("Do it.", sandbox, policy, cfg)
    assert traj.exit_reason == "submitted" and traj.no_call_turns == 1 and traj.turns == 2
    nudge = policy.seen[1][-1]
    assert nudge.role == "user" and "did not call a tool" in nudge.content and "submit" in nudge.content
    assert traj.steps[0].no_call and not traj.steps[1].no_call


def test_max_turns(sandbox, cfg):
    cfg = cfg.model_copy(update={"max_turns": 3})
    policy = ScriptedPolicy([[tool_call("list_dir")]] * 10)
    traj = run_episode("Loop.", sandbox, policy, cfg)
    assert traj.exit_reason == "max_turns" and traj.turns == 3 and len(policy.seen) == 3


def test_max_idle_turns_ends_a_run_of_turns_without_calls_and_a_call_resets_it(sandbox, cfg):
    cfg = cfg.model_copy(update={"max_turns": 20, "max_idle_turns": 2})
    policy = ScriptedPolicy(["Thinking.", [tool_call("list_dir")], "Still thinking.", "Hmm."] + ["x"] * 10)
    traj = run_episode("Idle.", sandbox, policy, cfg)
    assert traj.exit_reason == "idle" and "2 turns in a row without a tool call" in traj.error
    assert traj.turns == 4 and [s.no_call for s in traj.steps] == [True, False, True, True]
    never = run_episode("Idle.", sandbox, ScriptedPolicy(["x"] * 5), cfg.model_copy(update={"max_turns": 5,
                                                                                            "max_idle_turns": 0}))
    assert never.exit_reason == "max_turns" and never.turns == 5


def test_max_tokens_uses_the_policy_counts(sandbox, cfg):
    cfg = cfg.model_copy(update={"max_tokens": 2500})
    policy = ScriptedPolicy([
        PolicyOutput(text="", tool_calls=[tool_call("list_dir")], prompt_tokens=p, completion_tokens=100)
        for p in (1000, 2000, 3000, 4000)
    ])
    traj = run_episode("Loop.", sandbox, policy, cfg)
    assert traj.exit_reason == "max_tokens" and traj.turns == 3
    assert traj.context_tokens >= 3100 and traj.prompt_tokens == 6000
    assert not traj.steps[0].tokens_estimated


def test_tokens_are_estimated_when_the_policy_does_not_count(sandbox, cfg):
    cfg = cfg.model_copy(update={"max_tokens": 5000})
    chatter = "word " * 2000  # 10,000 chars = 2,500 estimated tokens per turn
    policy = ScriptedPolicy([chatter + SUBMIT.replace("submit", "list_dir").replace('"message": "done"', "")] * 5)
    traj = run_episode("Talk.", sandbox, policy, cfg)
    assert traj.exit_reason == "max_tokens" and traj.turns == 2
    assert traj.steps[0].tokens_estimated and traj.steps[0].completion_tokens == len(traj.steps[0].text) // 4


def test_wall_clock_limit_also_cuts_running_commands(sandbox, cfg):
    cfg = cfg.model_copy(update={"max_seconds": 1.5, "command_timeout": 30})
    policy = ScriptedPolicy([[tool_call("run", command="sleep 100")]] * 5)
    t0 = time.monotonic()
    traj = run_episode("Wait.", sandbox, policy, cfg)
    assert traj.exit_reason == "timeout"
    assert time.monotonic() - t0 < 8
    assert "timed out" in traj.steps[0].tool_events[0].observation


def test_policy_error_ends_the_episode_with_the_reason(sandbox, cfg):
    traj = run_episode("x", sandbox, ScriptedPolicy([[tool_call("list_dir")]]), cfg)
    assert traj.exit_reason == "policy_error" and "ScriptOver" in traj.error and traj.turns == 1


def test_submit_ends_the_turn_and_later_calls_do_not_run(sandbox, cfg):
    policy = ScriptedPolicy([[tool_call("submit", message="early"), tool_call("write_file", path="late.txt", content="x")]])
    traj = run_episode("x", sandbox, policy, cfg)
    assert traj.exit_reason == "submitted" and traj.final_message == "early"
    assert traj.steps[0].tool_events[1].observation.startswith("Not run")
    assert sandbox.exec("test -e late.txt").exit_code != 0


def test_transcript_round_trips_through_json(sandbox, cfg, tmp_path):
    out = PolicyOutput(text=SUBMIT, tool_calls=[ToolCall("submit", {"message": "ok"})], prompt_tokens=10,
                       completion_tokens=5, token_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3], policy_version=7)
    policy = ScriptedPolicy([[tool_call("read_file", path="README.md")], "nothing", out])
    steps = []
    traj = Agent(sandbox, policy, cfg, system_prompt="custom", on_step=steps.append).run("go", task_id="t9")
    assert len(steps) == 3 and traj.messages[0].content == "custom"
    path = traj.save(tmp_path / "runs" / "t9.json")
    assert [p.name for p in path.parent.iterdir()] == ["t9.json"]  # no temp file left behind
    data = json.loads(path.read_text())
    assert data["format"] == "opencomposer.trajectory/1" and data["exit_reason"] == "submitted"
    assert data["counts"]["turns"] == 3 and data["counts"]["no_call_turns"] == 1
    assert data["steps"][0]["tool_events"][0]["name"] == "read_file"
    assert data["steps"][2]["token_ids"] == [1, 2, 3] and data["steps"][2]["policy_version"] == 7
    back = Trajectory.load(path)
    assert back == traj and back.counts == traj.counts


class FullPolicy:
    name = "full"

    def act(self, messages, tools):
        raise ContextLengthError("prompt is 9000 tokens; the context holds 8192")


def test_per_token_versions_are_kept_only_for_a_turn_that_spans_two(sandbox, cfg):
    """``PolicyOutput.policy_versions`` (declared, as the engine and the server fill it) reaches the
    step only when new weights arrived mid-turn; a one-version turn needs no per-token list."""
    mixed = PolicyOutput(text="", tool_calls=[tool_call("list_dir")], token_ids=[5, 6, 7], logprobs=[-0.1] * 3,
                         policy_version=3, policy_versions=[3, 3, 4])
    uniform = PolicyOutput(text=SUBMIT, tool_calls=[ToolCall("submit", {"message": "ok"})], token_ids=[8, 9],
                           logprobs=[-0.1] * 2, policy_version=4, policy_versions=[4, 4])
    traj = run_episode("go", sandbox, ScriptedPolicy([mixed, uniform]), cfg)
    assert [s.policy_versions for s in traj.steps] == [[3, 3, 4], []]
    assert [s.policy_version for s in traj.steps] == [3, 4]


def test_a_policy_out_of_context_ends_as_max_tokens(sandbox, cfg):
    traj = run_episode("x", sandbox, FullPolicy(), cfg)
    assert traj.exit_reason == "max_tokens" and "context is full" in traj.error
