"""ModelPolicy on the tiny-random model: PolicyOutput fields, logprob meaning, seeds, context.

Run: ``pytest tests/unit/policies/test_model_policy.py``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from opencomposer.models.chat import encode_prompt, render_prompt
from opencomposer.policies.model import ModelPolicy
from opencomposer.protocols import ContextLengthError
from opencomposer.protocols import Message, Policy, PolicyOutput


def test_act_fills_policy_output(tiny, conversation, tools):
    policy = ModelPolicy(tiny, max_new_tokens=12, seed=0)
    assert isinstance(policy, Policy) and policy.name == "tiny-random"
    out = policy.act(conversation, tools)
    assert isinstance(out, PolicyOutput)
    assert out.prompt_tokens == len(encode_prompt(tiny[1], render_prompt(tiny[1], conversation, tools)))
    assert out.completion_tokens == len(out.token_ids) == len(out.logprobs) == 12
    assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs)
    assert out.finish_reason == "length"  # a random model does not find <|im_end|> in 12 tokens
    assert out.text == tiny[1].decode(out.token_ids)
    assert out.tool_calls == []


def recompute(model, prompt_ids, ids, temperature):
    """log p(ids) from one forward pass over prompt+completion, logits / temperature."""
    seq = torch.tensor([prompt_ids + ids])
    with torch.no_grad():
        logits = model(seq).logits[0, len(prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp[torch.arange(len(ids)), torch.tensor(ids)]


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_logprobs_are_the_samplers(tiny, conversation, tools, temperature):
    """What RL relies on: logprobs = log_softmax(logits / T) of the sampled tokens."""
    model, tok = tiny
    policy = ModelPolicy(tiny, temperature=temperature, max_new_tokens=8, seed=3)
    out = policy.act(conversation, tools)
    prompt_ids = encode_prompt(tok, render_prompt(tok, conversation, tools))
    expected = recompute(model, prompt_ids, out.token_ids, temperature or 1.0)
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)


def test_model_sampling_defaults_do_not_leak_in(tiny, conversation, tools):
    """A Qwen-like generation_config.json must not change what the sampler draws from."""
    model, tok = tiny
    saved = copy.deepcopy(model.generation_config)
    model.generation_config.update(repetition_penalty=50.0, top_k=5, top_p=0.5, min_p=0.2, temperature=0.1)
    try:
        out = ModelPolicy(tiny, temperature=1.0, max_new_tokens=8, seed=1).act(conversation, tools)
    finally:
        model.generation_config = saved
    prompt_ids = encode_prompt(tok, render_prompt(tok, conversation, tools))
    expected = recompute(model, prompt_ids, out.token_ids, 1.0)
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)


def test_seed_reproduces_and_leaves_global_rng_alone(tiny, conversation, tools):
    torch.manual_seed(123)
    control = torch.rand(3)
    torch.manual_seed(123)
    a = ModelPolicy(tiny, max_new_tokens=6, seed=7)
    first, second = a.act(conversation, tools), a.act(conversation, tools)
    assert torch.equal(torch.rand(3), control)
    b = ModelPolicy(tiny, max_new_tokens=6, seed=7)
    assert b.act(conversation, tools).token_ids == first.token_ids
    assert b.act(conversation, tools).token_ids == second.token_ids
    assert first.token_ids != second.token_ids  # call n uses seed + n


def test_stop_token_ends_turn_and_is_kept_in_ids(tiny, conversation, tools):
    greedy = ModelPolicy(tiny, temperature=0, max_new_tokens=1)
    first = greedy.act(conversation, tools).token_ids[0]
    greedy.stop_ids = greedy.stop_ids | {first}  # make the model's first choice a stop token
    greedy.max_new_tokens = 5
    out = greedy.act(conversation, tools)
    assert out.finish_reason == "stop"
    assert out.token_ids == [first] and len(out.logprobs) == 1
    assert out.text == ""


def test_context_limits(tiny, conversation, tools):
    n = len(encode_prompt(tiny[1], render_prompt(tiny[1], conversation, tools)))
    with pytest.raises(ContextLengthError, match=f"prompt is {n} tokens but tiny-random's context is {n}"):
        ModelPolicy(tiny, max_context=n).act(conversation, tools)
    out = ModelPolicy(tiny, max_context=n + 3, max_new_tokens=50, seed=0).act(conversation, tools)
    assert out.completion_tokens == 3 and out.finish_reason == "length"


def test_bad_settings_are_rejected(tiny):
    with pytest.raises(ValueError, match="top_p=1.5"):
        ModelPolicy(tiny, top_p=1.5)


def test_policy_from_name_and_version(tiny):
    policy = ModelPolicy("tiny-random", max_new_tokens=2, policy_version=4)
    assert policy.act([Message("user", "hi")], []).policy_version == 4
