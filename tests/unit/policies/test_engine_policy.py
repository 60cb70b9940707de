"""EnginePolicy answers like ModelPolicy: same prompt, same greedy tokens, same fields."""

from __future__ import annotations

import pytest

from opencomposer.inference.engine.core import Engine
from opencomposer.policies.engine import EnginePolicy
from opencomposer.policies.model import ModelPolicy
from opencomposer.protocols import ContextLengthError
from opencomposer.models.registry import load_model
from opencomposer.protocols import Message


def test_engine_policy_matches_model_policy_greedy():
    hf, tok = load_model("tiny-random")
    engine = Engine(hf, tok, max_model_len=512)
    policy = EnginePolicy(engine, temperature=0, max_new_tokens=12)
    reference = ModelPolicy((hf, tok), temperature=0, max_new_tokens=12, max_context=512)
    messages = [Message("user", "List the files, then read setup.py")]
    ids = policy.encode(messages, [])
    assert ids == reference.encode(messages, [])
    [out] = policy.sample_batch([ids])
    [ref] = reference.sample_batch([ids])
    assert out.token_ids == ref.token_ids and out.text == ref.text
    assert out.finish_reason == ref.finish_reason
    assert len(out.logprobs) == len(out.token_ids) and all(lp <= 0 for lp in out.logprobs)
    assert out.policy_version == 0 and out.policy_versions == [0] * len(out.token_ids)
    assert out.prompt_tokens == len(ids)
    with pytest.raises(ContextLengthError, match="max_model_len is 512"):
        policy.encode([Message("user", "word " * 600)], [])
    with pytest.raises(AttributeError, match="update_weights"):
        policy.policy_version = 3
    policy.update_weights(hf.state_dict(), version=3)
    assert policy.policy_version == 3 and policy.sample_batch([ids])[0].policy_version == 3
    assert engine.stats()["kv_blocks_used"] == 0
