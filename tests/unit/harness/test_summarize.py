"""Self-summarisation: an episode longer than its context window goes on through summaries,
and every segment of the chain becomes training data with the chain's one reward."""

from __future__ import annotations

from pathlib import Path

import pytest

from opencomposer.config import AgentConfig
from opencomposer.policies.oracle import OraclePolicy
from opencomposer.harness.prompt import agent_tools
from opencomposer.harness.summarize import (
    SUMMARY_HEADER, is_summary_request, next_segment, recent_turns, summary_of, summary_request,
)
from opencomposer.harness.trajectory import Trajectory
from opencomposer.models.chat import encode_prompt, render_prompt
from opencomposer.models.registry import load_model
from opencomposer.protocols import Message, PolicyOutput, ToolCall
from opencomposer.train.samples import trajectory_samples, turn_contexts
from opencomposer.tasks.deletion import make_patch
from testkit.oracle_tasks import STATS, STATS_DELETED, make_task, solve

# The oracle's whole trajectory on the stats task is ~1,360 tokens (prompt ~1,014 with the
# tool schemas); a 1,300-token window cannot hold it.
WINDOW = AgentConfig(max_tokens=1300)
SUMMARISING = AgentConfig(max_tokens=1300, summarize_at=1100)


@pytest.fixture
def stats_task(tmp_path):
    return make_task(tmp_path / "task", {"mathy/__init__.py": "", "mathy/stats.py": STATS},
                     {"mathy/stats.py": STATS_DELETED}, make_patch(STATS, STATS_DELETED, "mathy/stats.py"),
                     "mathy.stats.mean")


def test_the_window_alone_is_too_small_for_the_task(stats_task):
    sb, traj = solve(stats_task, WINDOW)
    sb.close()
    assert traj.exit_reason == "max_tokens" and traj.summaries == 0  # cut off before its check and submit


def test_the_oracle_solves_it_through_summaries(stats_task):
    sb, traj = solve(stats_task, SUMMARISING)
    with sb:
        assert sb.read_file("mathy/stats.py").decode() == STATS
    assert traj.exit_reason == "submitted"
    assert traj.summaries >= 1 and len(traj.segments) == traj.summaries
    # every working turn's prompt fitted the window (a summary request may add one turn's growth)
    assert max(s.prompt_tokens for s in traj.steps if not s.summary) < SUMMARISING.max_tokens
    for seg in traj.segments:  # each closed segment ends with the request and the summary
        assert is_summary_request(seg[-2]) and seg[-1].role == "assistant" and "mean" in seg[-1].content
    assert summary_of(traj.messages) is not None and traj.messages[1].content == stats_task.instruction
    # steps know their segment, and the summary turns are marked
    assert [s.segment for s in traj.steps] == sorted(s.segment for s in traj.steps)
    assert sum(s.summary for s in traj.steps) == traj.summaries
    assert len(turn_contexts(traj)) == traj.turns


def test_segments_survive_the_transcript(stats_task, tmp_path):
    _, traj = solve(stats_task, SUMMARISING)
    back = Trajectory.load(traj.save(tmp_path / "t.json"))
    assert back.segments == traj.segments and back.messages == traj.messages
    assert back.counts == traj.counts and back.counts["summaries"] >= 1


class TokenizedOracle:
    """The oracle's turns as a local model would report them: token ids, prompt length."""

    def __init__(self, task, tokenizer):
        self.oracle, self.tok = OraclePolicy(task), tokenizer

    def act(self, messages, tools):
        out = self.oracle.act(messages, tools)
        prompt = encode_prompt(self.tok, render_prompt(self.tok, messages, tools))
        ids = encode_prompt(self.tok, out.text + "<|im_end|>")
        return PolicyOutput(text=out.text, tool_calls=out.tool_calls, token_ids=ids, logprobs=[-0.5] * len(ids),
                            prompt_tokens=len(prompt), completion_tokens=len(ids), policy_version=3)


def test_the_trainer_sees_every_segment_with_the_chains_reward(stats_task):
    from opencomposer.harness.loop import run_episode
    from opencomposer.protocols import SandboxSpec
    from opencomposer.sandbox import make_sandbox
    import sys

    _, tok = load_model("tiny-random")
    policy = TokenizedOracle(stats_task, tok)
    cfg = AgentConfig(max_tokens=1500, summarize_at=1300)  # the tokenizer's counts, not chars/4
    with make_sandbox(SandboxSpec(base_dir=stats_task.workspace, env_dir=Path(sys.prefix)), "local") as sb:
        traj = run_episode(stats_task.instruction, sb, policy, cfg, task_id=stats_task.id)
    assert traj.exit_reason == "submitted" and traj.summaries >= 1
    samples = trajectory_samples(traj, tok, agent_tools(), advantage=0.75, group_id="g")  # checks prompt lengths
    segments = len(traj.segments) + 1
    assert len(samples) == segments  # one sequence per segment: each starts over from the system prompt
    assert {s.advantage for s in samples} == {0.75}
    assert sum(s.loss_tokens for s in samples) == sum(len(s.token_ids) for s in traj.steps)
    for sample, seg in zip(samples, traj.all_segments()):
        start = encode_prompt(tok, render_prompt(tok, seg[:2], agent_tools()))[:-5]
        assert sample.input_ids[: len(start)] == start


def test_a_summary_is_not_itself_summarised_and_the_count_is_capped(stats_task):
    # a window so small the resumed segment is already past the trigger: one step per segment,
    # then, with max_summaries spent, the context limit ends the episode
    cfg = AgentConfig(max_tokens=1150, summarize_at=1020, max_summaries=2)
    _, traj = solve(stats_task, cfg)
    assert traj.summaries == 2 and traj.exit_reason == "max_tokens"
    kinds = [s.summary for s in traj.steps]
    assert not any(a and b for a, b in zip(kinds, kinds[1:]))  # never two summaries in a row


def test_recent_turns_carry_calls_and_observations():
    msgs = [Message("system", "S"), Message("user", "T"),
            Message("assistant", "look", tool_calls=[ToolCall("list_dir", {"path": "."}, "c1")]),
            Message("tool", "a.py\nb.py", tool_call_id="c1", name="list_dir"),
            Message("assistant", "", tool_calls=[ToolCall("read_file", {"path": "a.py"}, "c2")]),
            Message("tool", "x" * 2000, tool_call_id="c2", name="read_file"),
            summary_request(), Message("assistant", "my summary")]
    text = recent_turns(msgs, 1)
    assert 'read_file({"path": "a.py"})' in text and "list_dir" not in text and "[...]" in text
    seg = next_segment(msgs, "my summary", keep_turns=2)
    assert [m.role for m in seg] == ["system", "user", "user"]
    assert seg[2].content.startswith(SUMMARY_HEADER + "my summary") and "list_dir" in seg[2].content
    assert "my summary" not in recent_turns(msgs, 5)  # the summary turn itself is not a 'recent turn'
