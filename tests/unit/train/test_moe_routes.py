"""A MoE model's routes from the engine to the trainer: a real episode (``harness.loop.Agent``
in a local sandbox) on a tiny Qwen3-MoE behind ``EnginePolicy``, its trajectory saved and
loaded, turned into samples, and the trainer's forward pass replaying the recorded routes."""

from __future__ import annotations

import pytest
import torch

from opencomposer.config import AgentConfig
from opencomposer.harness.loop import Agent
from opencomposer.harness.prompt import agent_tools
from opencomposer.harness.trajectory import Trajectory
from opencomposer.inference.engine.core import Engine
from opencomposer.policies.engine import EnginePolicy
from opencomposer.models import load_model
from opencomposer.models.moe_replay import decode_routes, encode_routes, routers
from opencomposer.train.samples import SampleError, trajectory_samples
from opencomposer.train.config import TrainConfig
from opencomposer.train.trainer import Trainer


@pytest.fixture(scope="module")
def moe():
    """A 2-layer Qwen3-MoE (8 experts, 2 a token) with tiny-random's tokenizer, fp32."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    _, tok = load_model("tiny-random")
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                         initializer_range=0.1, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(cfg).eval()
    return model, tok


def test_routes_travel_from_the_engine_to_the_trainers_forward_pass(moe, sandbox, tmp_path):
    model, tok = moe
    engine = Engine(model, tok, max_num_seqs=2, max_model_len=2048)
    policy = EnginePolicy(engine, temperature=1.0, max_new_tokens=24, seed=0)
    traj = Agent(sandbox, policy, AgentConfig(max_turns=3)).run("Fix add in calc/core.py.", task_id="t1")
    assert traj.turns >= 2 and all(s.routes for s in traj.steps)
    traj.save(tmp_path / "t.json")  # routes survive the transcript file
    again = Trajectory.load(tmp_path / "t.json")
    samples = trajectory_samples(again, tok, agent_tools(), advantage=1.0)
    assert samples and all(s.routes is not None for s in samples)
    for s in samples:
        assert tuple(s.routes.shape) == (len(s) - 1, 2, 2)

    trainer = Trainer(model, tok, TrainConfig(bf16=False))  # fp32, as the sampler: no autocast where the CPU has bf16
    for s in samples:
        b = trainer._collate([s])
        replayed, _ = trainer._logprobs(model, b, 1.0)
        # the trainer's logprobs of the sampled tokens are the sampler's (same weights, fp32)
        assert (replayed - b.old).mul(b.mask).abs().max() < 1e-4

    # a trainer a step ahead (its routers moved): the recorded routes keep it on the sampler's experts
    with torch.no_grad():
        for r in routers(model):
            r.weight.add_(0.02 * torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(1)))
    gaps = {True: [], False: []}
    for s in samples:
        for replay in (True, False):
            b = trainer._collate([s] if replay else [_without_routes(s)])
            lp, _ = trainer._logprobs(model, b, 1.0)
            gaps[replay].append(((lp - b.old).abs() * b.mask).sum() / b.mask.sum())
    assert torch.stack(gaps[True]).mean() < torch.stack(gaps[False]).mean()


def test_routes_that_do_not_fit_the_sequence_are_refused(moe, sandbox):
    model, tok = moe
    engine = Engine(model, tok, max_num_seqs=2, max_model_len=2048)
    traj = Agent(sandbox, EnginePolicy(engine, max_new_tokens=8, seed=1), AgentConfig(max_turns=1)).run("Hi", task_id="t2")
    step = traj.steps[0]
    good = step.routes
    n = decode_routes(good).shape[0]
    step.routes = encode_routes(decode_routes(good)[:-1])  # a token short
    with pytest.raises(SampleError, match=rf"trajectory t2: routes of {n - 1} tokens .* expected {n}"):
        trajectory_samples(traj, tok, agent_tools(), advantage=0.0)
    step.routes = good[:-3]  # a damaged transcript
    with pytest.raises(SampleError, match=r"trajectory t2 turn 0: routes .* expected 'n,layers,k:<base64 int16>'"):
        trajectory_samples(traj, tok, agent_tools(), advantage=0.0)
    step.routes = good
    assert trajectory_samples(traj, tok, agent_tools(), advantage=0.0)[0].routes.shape[0] == n


class RoutedScript:
    """Scripted turns (canonical renderings, so each prompt extends the last turn) that report
    what a MoE engine would: prompt ids and routes of prompt + completion, here a known
    function of each token and its position, so joined routes can be checked exactly."""

    def __init__(self, tok, broken_turn: int | None = None):
        from opencomposer.models.codec import format_assistant
        from opencomposer.policies.scripted import tool_call

        self.tok, self.broken, self.seen = tok, broken_turn, []
        self.turns = [format_assistant("Let me look.", [tool_call("list_dir")]),
                      format_assistant("", [tool_call("read_file", path="calc/core.py")]),
                      format_assistant("Fixed.", [tool_call("submit", message="done")])]

    def act(self, messages, tools):
        from opencomposer.models.codec import parse_tool_calls
        from opencomposer.models import encode_prompt, render_prompt
        from opencomposer.protocols import PolicyOutput

        k = len(self.seen)
        self.seen.append(list(messages))
        prompt = encode_prompt(self.tok, render_prompt(self.tok, messages, tools))
        text = f"  {self.turns[k]}" if k == self.broken else self.turns[k]  # stray spaces break the prefix
        ids = encode_prompt(self.tok, text) + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        return PolicyOutput(text, parse_tool_calls(text)[1], prompt_tokens=len(prompt), completion_tokens=len(ids),
                            token_ids=ids, logprobs=[-0.5] * len(ids), routes=encode_routes(expected(prompt + ids)[:-1]),
                            prompt_ids=prompt)


def expected(ids: list[int]) -> torch.Tensor:
    pos = torch.arange(len(ids))
    t = torch.tensor(ids)
    return torch.stack([torch.stack([(t + pos) % 8, (t * 3 + pos) % 8], -1),
                        torch.stack([(t * 5 + pos) % 8, (t + 7 * pos) % 8], -1)], 1).to(torch.int16)


@pytest.mark.parametrize("broken", [None, 1])
def test_a_transcript_keeps_each_tokens_routes_once_and_samples_join_them(moe, sandbox, tmp_path, broken):
    _, tok = moe
    policy = RoutedScript(tok, broken_turn=broken)
    traj = Agent(sandbox, policy).run("Fix add.", task_id="t3")
    assert traj.exit_reason == "submitted" and len(traj.steps) == 3
    froms = [s.routes_from for s in traj.steps]
    if broken is None:  # each turn extends the last: turns 2 and 3 store only their new tokens
        assert froms[0] == 0 and 0 < froms[1] < froms[2]
        assert decode_routes(traj.steps[2].routes).shape[0] < traj.steps[2].prompt_tokens // 2
    else:  # turn 2's sampled text does not re-render as sampled: turn 3 cannot extend it
        assert froms[2] == 0
    traj.save(tmp_path / "t.json")
    samples = trajectory_samples(Trajectory.load(tmp_path / "t.json"), tok, agent_tools(), advantage=1.0)
    assert len(samples) == (1 if broken is None else 2)
    for s in samples:  # joined or not, every sequence's routes are its tokens' own
        assert torch.equal(s.routes, expected(s.input_ids)[:-1])


def _without_routes(s):
    from dataclasses import replace

    return replace(s, routes=None)
