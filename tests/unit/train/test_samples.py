"""Trajectories -> training sequences, checked against what the policy was really shown.

Real episodes through ``harness.loop.Agent`` in a local sandbox: a tiny-random
``ModelPolicy`` whose model records the exact ids handed to ``generate``, and scripted
policies (tokens in the canonical rendering, or no tokens at all, like the oracle).
"""

from __future__ import annotations

from typing import Any

import pytest

from opencomposer.config import AgentConfig
from opencomposer.models.codec import format_assistant
from opencomposer.harness.loop import Agent
from opencomposer.harness.prompt import agent_tools
from opencomposer.policies.scripted import ScriptedPolicy, tool_call
from opencomposer.harness.trajectory import Trajectory
from opencomposer.models import encode_prompt, load_model, render_prompt
from opencomposer.policies.model import ModelPolicy
from opencomposer.protocols import PolicyOutput
from opencomposer.train.samples import (
    Sample,
    SampleError,
    sft_samples,
    trajectory_samples,
    turn_contexts,
)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


@pytest.fixture(autouse=True)
def one_thread():
    """Sampling a tiny model on a busy 2-core box: 2 spinning OpenMP threads ran 10x slower than 1."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class RecordingModel:
    """The real model, noting the prompt ids every ``generate`` call receives."""

    def __init__(self, model: Any):
        self.model, self.prompts = model, []

    def generate(self, input_ids, **kwargs):
        self.prompts.append(input_ids[0].tolist())
        return self.model.generate(input_ids=input_ids, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def spans(samples: list[Sample]) -> list[tuple[Sample, int, int]]:
    """Every maximal run of loss-mask 1s, as (sample, start, end)."""
    out = []
    for s in samples:
        t = 0
        while t < len(s):
            if s.loss_mask[t]:
                end = t
                while end < len(s) and s.loss_mask[end]:
                    end += 1
                out.append((s, t, end))
                t = end
            else:
                t += 1
    return out


TURNS = [("Let me look.", [tool_call("list_dir")]),
         ("", [tool_call("read_file", path="calc/core.py")]),
         ("Fixed.", [tool_call("submit", message="done")])]


def scripted(tok, with_tokens: bool, broken_turn: int | None = None) -> ScriptedPolicy:
    """Oracle-like turns; with tokens, as a model writing the canonical rendering would emit them."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    outs = []
    for k, (prose, calls) in enumerate(TURNS):
        text = format_assistant(prose, calls)
        if not with_tokens:
            outs.append(text)
            continue
        # A turn with stray spaces: the loop keeps the stripped prose, so re-rendering differs.
        sampled = f"  {text}" if k == broken_turn else text
        ids = encode_prompt(tok, sampled) + [end]
        outs.append(PolicyOutput(sampled, calls, token_ids=ids, logprobs=[-0.5] * len(ids), policy_version=k))
    return ScriptedPolicy(outs)


def test_reconstructed_prompts_are_byte_identical_to_the_models(tiny, sandbox):
    model, tok = tiny
    recorder = RecordingModel(model)
    policy = ModelPolicy((recorder, tok), temperature=1.0, max_new_tokens=12, seed=0)
    traj = Agent(sandbox, policy, AgentConfig(max_turns=2)).run("Fix add in calc/core.py.", task_id="t1")
    assert traj.turns == 2 and len(recorder.prompts) == 2
    for k, (history, _) in enumerate(turn_contexts(traj)):
        assert encode_prompt(tok, render_prompt(tok, history, agent_tools())) == recorder.prompts[k]

    samples = trajectory_samples(traj, tok, agent_tools(), advantage=0.5, group_id="g")
    runs = spans(samples)
    assert len(runs) == 2  # one loss span per turn, zeros on every prompt and nudge token
    for k, (s, start, end) in enumerate(runs):
        assert s.input_ids[:start] == recorder.prompts[k]
        assert s.input_ids[start:end] == traj.steps[k].token_ids
        assert s.old_logprobs[start:end] == traj.steps[k].logprobs
        assert (s.advantage, s.task_id, s.group_id) == (0.5, "t1", "g")
    for s in samples:
        assert all(lp == 0.0 for lp, m in zip(s.old_logprobs, s.loss_mask) if not m)
    # A saved transcript gives the same samples; other tools would not match the rollout.
    again = Trajectory.from_dict(Trajectory.from_dict(traj.to_dict()).to_dict())
    assert trajectory_samples(again, tok, agent_tools(), advantage=0.5, group_id="g") == samples
    with pytest.raises(SampleError, match="turn 0: reconstructed prompt"):
        trajectory_samples(traj, tok, [], advantage=0.5)


def test_turns_merge_into_one_sequence_when_the_prefix_holds(tiny, sandbox):
    _, tok = tiny
    policy = scripted(tok, with_tokens=True)
    traj = Agent(sandbox, policy).run("Fix add.")
    assert traj.exit_reason == "submitted"
    samples = trajectory_samples(traj, tok, agent_tools(), advantage=1.0)
    assert len(samples) == 1
    runs = spans(samples)
    assert len(runs) == 3
    for k, (s, start, end) in enumerate(runs):
        assert s.input_ids[:start] == encode_prompt(tok, render_prompt(tok, policy.seen[k], agent_tools()))
        assert s.input_ids[start:end] == traj.steps[k].token_ids
        assert set(s.policy_version[start:end]) == {k}
    s = samples[0]
    observations = tok.decode([t for t, m in zip(s.input_ids[runs[0][2]:], s.loss_mask[runs[0][2]:]) if not m])
    assert "<tool_response>" in observations and "calc/" in observations  # tool output: mask 0
    assert s.loss_tokens == sum(len(st.token_ids) for st in traj.steps)


def test_a_broken_prefix_starts_a_new_sequence(tiny, sandbox):
    _, tok = tiny
    policy = scripted(tok, with_tokens=True, broken_turn=1)
    traj = Agent(sandbox, policy).run("Fix add.")
    samples = trajectory_samples(traj, tok, agent_tools(), advantage=-1.0)
    # turn 1's sampled tokens are not what the next prompt re-renders: turn 2 starts afresh
    assert [len(spans([s])) for s in samples] == [2, 1]
    prompt2 = encode_prompt(tok, render_prompt(tok, policy.seen[2], agent_tools()))
    assert samples[1].input_ids[: len(prompt2)] == prompt2
    assert samples[1].input_ids[len(prompt2):] == traj.steps[2].token_ids


def test_sft_samples_teach_exactly_the_assistant_turns(tiny, sandbox):
    _, tok = tiny
    policy = scripted(tok, with_tokens=False)
    traj = Agent(sandbox, policy).run("Fix add.")
    assert trajectory_samples(traj, tok, agent_tools(), advantage=1.0) == []  # no sampled tokens
    samples = sft_samples(traj, tok, agent_tools())
    assert len(samples) == 1
    runs = spans(samples)
    assert len(runs) == 3
    for k, (s, start, end) in enumerate(runs):
        assert s.input_ids[:start] == encode_prompt(tok, render_prompt(tok, policy.seen[k], agent_tools()))
        assert tok.decode(s.input_ids[start:end]) == format_assistant(*TURNS[k]) + "<|im_end|>"
        assert s.old_logprobs[start:end] == [0.0] * (end - start) and s.advantage == 1.0


def test_bad_samples_and_histories_are_refused(tiny, sandbox):
    _, tok = tiny
    with pytest.raises(SampleError, match="old_logprobs has 1 entries, input_ids has 2"):
        Sample([1, 2], [0, 1], [0.0])
    with pytest.raises(SampleError, match="loss_mask\\[0\\]"):
        Sample([1, 2], [1, 1], [0.0, 0.0])
    traj = Agent(sandbox, scripted(tok, with_tokens=True)).run("Fix add.")
    del traj.messages[2]  # as if the history had been rewritten
    with pytest.raises(SampleError, match="3 steps but 2 assistant messages"):
        trajectory_samples(traj, tok, agent_tools(), advantage=1.0)
