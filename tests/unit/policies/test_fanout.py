"""FanoutPolicy over real engines on tiny-random (CPU): a group stays on one engine, a new group
goes to the least-loaded; two engines on the same weights answer alike; a failed engine step
voids its episodes and takes the engine out (rebuilt, or dropped); a failed weight update names
the engine. A failure is made by patching one real engine's ``step`` to raise once.

Run: ``pytest tests/unit/policies/test_fanout.py``.
"""

from __future__ import annotations

import pytest
import torch

from opencomposer.inference.engine.core import Engine
from opencomposer.policies.batched import BatchedPolicy, EngineStepError
from opencomposer.policies.engine import EnginePolicy
from opencomposer.policies.fanout import EngineError, EngineFailed, FanoutPolicy
from opencomposer.protocols import Message

CONV = [Message("system", "You are a coding agent."), Message("user", "Fix the bug in stats.py.")]


def engine(tiny) -> BatchedPolicy:
    hf, tok = tiny
    return BatchedPolicy(EnginePolicy(Engine(hf, tok, max_model_len=256), temperature=0, max_new_tokens=6))


def fanout(tiny, n: int = 2, rebuild=None) -> FanoutPolicy:
    return FanoutPolicy([engine(tiny) for _ in range(n)], [f"engine {i} (cpu)" for i in range(n)], rebuild=rebuild)


def enter(policy: FanoutPolicy, group):
    """An episode of ``group`` left open: (its context manager, its session)."""
    cm = policy.episode(group=group)
    return cm, cm.__enter__()


def leave(cm) -> None:
    cm.__exit__(None, None, None)


def fail_once(policy: FanoutPolicy, i: int) -> None:
    """Engine i's next step raises (the real engine object; later steps run as usual)."""
    eng = policy.slots[i].policy.policy.engine
    real, calls = eng.step, [0]

    def step():
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real()

    eng.step = step


def test_a_group_stays_on_its_engine_and_a_new_group_takes_the_least_loaded(tiny):
    with fanout(tiny, 3) as policy:
        a0, sa0 = enter(policy, "a")
        a1, sa1 = enter(policy, "a")  # engine 0 is now the busiest, but the group stays
        b0, sb0 = enter(policy, "b")
        _, sc0 = enter(policy, "c")
        d0, sd0 = enter(policy, "d")  # engines 1 and 2 tie at one live episode: the lower index
        assert [s.engine for s in (sa0, sa1, sb0, sc0, sd0)] == [0, 0, 1, 2, 1]
        out = sa1.act(CONV, [])
        assert out.token_ids and sb0.act(CONV, []).token_ids == out.token_ids  # same weights, greedy
        figures = policy.figures()
        assert (figures["engine_requests_0"], figures["engine_requests_1"], figures["engine_requests_2"]) == (1, 1, 0)
        assert (figures["engine_episodes_0"], figures["engine_episodes_1"], figures["engine_episodes_2"]) == (2, 2, 1)
        for cm in (b0, d0):
            leave(cm)
        _, se = enter(policy, "e")
        assert se.engine == 1  # now the only idle engine
        for cm in (a0, a1):
            leave(cm)
        _, sa2 = enter(policy, "a")  # a group that comes back finds its engine, idle or not
        assert sa2.engine == 0
        assert policy.stats["requests"] == 2 and policy.max_batch == 3 * 8


def test_two_engines_on_the_same_weights_answer_alike_before_and_after_an_update(tiny):
    with fanout(tiny) as policy:
        (_, s0), (_, s1) = enter(policy, "x"), enter(policy, "y")
        assert (s0.engine, s1.engine) == (0, 1)
        o0, o1 = s0.act(CONV, []), s1.act(CONV, [])
        assert o0.token_ids == o1.token_ids and o0.policy_versions == o1.policy_versions == [0] * len(o0.token_ids)
        assert max(abs(a - b) for a, b in zip(o0.logprobs, o1.logprobs)) < 1e-5
        gen = torch.Generator().manual_seed(0)
        state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in tiny[0].state_dict().items()
                 if v.is_floating_point()}
        policy.each(lambda p: p.policy.update_weights(state, 1), "take the weights of version 1")
        assert policy.versions() == {0: 1, 1: 1} and policy.policy_version == 1
        n0, n1 = s0.act(CONV, []), s1.act(CONV, [])
        assert n0.token_ids == n1.token_ids and set(n0.policy_versions) == set(n1.policy_versions) == {1}
        assert max(abs(a - b) for a, b in zip(n0.logprobs, n1.logprobs)) < 1e-5
        assert n0.logprobs != o0.logprobs  # the update did change the weights


def test_a_failed_step_voids_its_episodes_and_a_fresh_engine_takes_its_place(tiny):
    fresh: list[BatchedPolicy] = []

    def rebuild(i: int) -> BatchedPolicy:
        fresh.append(engine(tiny))
        return fresh[-1]

    with fanout(tiny, rebuild=rebuild) as policy:
        fail_once(policy, 1)
        a, sa = enter(policy, "a")
        b, sb = enter(policy, "b")
        b2, sb2 = enter(policy, "b")  # between two turns when its engine fails
        assert (sa.engine, sb.engine, sb2.engine) == (0, 1, 1)
        failed = r"rollout engine 1 \(cpu\) failed: RuntimeError: CUDA error.*replaces it at the next weight sync"
        with pytest.warns(RuntimeWarning, match=failed), pytest.raises(EngineStepError):
            sb.act(CONV, [])
        assert sb.failure.startswith("engine 1 (cpu) failed")
        with pytest.raises(EngineFailed, match=r"engine 1 \(cpu\) failed"):
            leave(b)  # the episode is void: collect_rollouts records a failed rollout
        assert policy.up == 1 and policy.figures()["engine_failures_1"] == 1
        expected = sa.act(CONV, [])  # the other engine serves on
        assert sb2.act(CONV, []).token_ids == expected.token_ids and sb2.engine == 0  # moved, with its group
        leave(b2)  # not void: its engine failed between its turns
        _, sc = enter(policy, "c")
        assert sc.engine == 0  # the only engine up
        assert policy.revive() == [1] and policy.slots[1].policy is fresh[0] and policy.up == 2
        _, sd = enter(policy, "d")
        assert sd.engine == 1 and sd.act(CONV, []).token_ids == expected.token_ids
        assert policy.revive() == []  # nothing failed since
        leave(a)
        # the failed engine's totals stay in the sums, so a step's deltas never go back
        assert policy.stats["requests"] >= 4 and policy.engine_counts()["steps"] > 0


def test_without_a_rebuild_a_failed_engine_stays_out_and_with_none_left_dispatch_says_why(tiny):
    with fanout(tiny) as policy:
        fail_once(policy, 0)
        fail_once(policy, 1)
        (_, s0), (_, s1) = enter(policy, "a"), enter(policy, "b")
        dropped = r"engine 1 \(cpu\).*dropped from dispatch for the rest of the run"
        with pytest.warns(RuntimeWarning, match=dropped), pytest.raises(EngineStepError):
            s1.act(CONV, [])
        assert policy.revive() == [] and policy.up == 1
        with pytest.warns(RuntimeWarning, match=r"engine 0 \(cpu\)"), pytest.raises(EngineStepError):
            s0.act(CONV, [])
        says = r"no rollout engine is up: engine 0 \(cpu\): RuntimeError: CUDA error.*; engine 1 \(cpu\): RuntimeError"
        with pytest.raises(EngineFailed, match=says):
            policy.revive()
        with pytest.raises(EngineFailed, match=says):
            enter(policy, "c")


def test_a_failed_weight_update_names_the_engine(tiny):
    with fanout(tiny) as policy:
        def refuse(state, version):
            raise RuntimeError("CUDA out of memory")

        policy.slots[1].policy.policy.engine.update_weights = refuse
        state = tiny[0].state_dict()
        with pytest.raises(EngineError, match=r"rollout engine 1 \(cpu\): could not take the weights of version 3: "
                                              r"RuntimeError: CUDA out of memory"):
            policy.each(lambda p: p.policy.update_weights(state, 3), "take the weights of version 3")
        assert policy.versions() == {0: 3, 1: 0}  # the run stops on the error; nothing pretends otherwise
