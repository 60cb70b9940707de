"""BatchedPolicy's continuous mode over a real engine on tiny-random (CPU).

Orderings are forced with events on a spy around ``Engine.step`` (the real step runs), never
with timing thresholds. Run: ``pytest tests/unit/policies/test_continuous.py``.
"""

from __future__ import annotations

import threading
import time

import pytest

from opencomposer.inference.engine.core import Engine
from opencomposer.models.registry import load_model
from opencomposer.policies.batched import BatchedPolicy, BatchGenerationError
from opencomposer.policies.engine import EnginePolicy
from opencomposer.policies.model import ModelPolicy
from opencomposer.protocols import ContextLengthError, Message

MAX_LEN = 256


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def engine_policy(tiny, **kw) -> EnginePolicy:
    hf, tok = tiny
    return EnginePolicy(Engine(hf, tok, max_model_len=MAX_LEN), **{"temperature": 0, **kw})


def conversation(n: int) -> list[Message]:
    return [Message("system", "You are a coding agent."), Message("user", "Fix the bug. " * n)]


def in_threads(policy: BatchedPolicy, convs: list[list[Message]], done: list[threading.Event] | None = None,
               on_return=None) -> tuple[list, list[threading.Thread]]:
    """Each conversation's ``act`` in its own thread; results (or exceptions) fill the list."""
    results: list = [None] * len(convs)

    def one(i: int) -> None:
        try:
            results[i] = policy.act(convs[i], [])
        except Exception as e:
            results[i] = e
        if on_return is not None:
            on_return(i)
        if done is not None:
            done[i].set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    return results, threads


def join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller hung"


def spy_steps(engine: Engine, after) -> None:
    """Run ``after(step_number, outputs)`` after each real engine step (in the worker)."""
    real, count = engine.step, [0]

    def step():
        outs = real()
        count[0] += 1
        after(count[0], outs)
        return outs

    engine.step = step


def test_continuous_is_the_default_over_an_engine_only(tiny):
    with BatchedPolicy(engine_policy(tiny)) as cont, BatchedPolicy(ModelPolicy(tiny, max_new_tokens=2)) as batch:
        assert cont.continuous and not batch.continuous
    with pytest.raises(ValueError, match="EnginePolicy"):
        BatchedPolicy(ModelPolicy(tiny, max_new_tokens=2), continuous=True)


def test_a_short_turn_returns_while_a_long_one_still_decodes(tiny):
    inner = engine_policy(tiny, max_new_tokens=120)
    long_turn = conversation(1)  # budget 120 tokens
    short_turn = conversation(1)
    while MAX_LEN - len(inner.encode(short_turn, [])) > 6:  # the context's end leaves it a few tokens
        short_turn = short_turn[:1] + [Message("user", short_turn[1].content + " Fix the bug.")]
    assert inner._budget(inner.encode(short_turn, [])) <= 6
    seen, first_finished = threading.Event(), threading.Event()

    def after(n, outs):  # once a request finished, the worker waits until its caller looked
        if first_finished.is_set():
            assert seen.wait(30)
        if any(o.finished for o in outs):
            first_finished.set()

    spy_steps(inner.engine, after)
    done = [threading.Event(), threading.Event()]
    long_done_when_short_returned = []
    with BatchedPolicy(inner, max_wait=10.0) as policy:
        def on_return(i):
            if i == 1:
                long_done_when_short_returned.append(done[0].is_set())
                seen.set()

        outs, threads = in_threads(policy, [long_turn, short_turn], done, on_return)
        join(threads)
    assert long_done_when_short_returned == [False]
    assert len(outs[1].token_ids) <= 6 < len(outs[0].token_ids)
    assert max(policy.batch_sizes) == 2 and policy.stats["requests"] == 2
    assert 1 < policy.mean_running <= 2 and policy.stats["generate_seconds"] > 0


def test_greedy_outputs_equal_sample_batch(tiny):
    convs = [conversation(1), conversation(9), conversation(25), conversation(3)]
    reference = engine_policy(tiny, max_new_tokens=16)
    expected = reference.sample_batch([reference.encode(c, []) for c in convs])
    inner = engine_policy(tiny, max_new_tokens=16)
    with BatchedPolicy(inner, max_batch=3) as policy:  # one request queues for room
        outs, threads = in_threads(policy, convs)
        join(threads)
        assert max(policy.batch_sizes) <= 3
    for a, b in zip(expected, outs):
        assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
        assert b.prompt_ids == a.prompt_ids and b.tool_calls == a.tool_calls
        assert b.policy_versions == a.policy_versions and b.policy_version == a.policy_version == 0
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert inner.engine.stats()["kv_blocks_used"] == 0


def test_seeds_are_one_call_per_request(tiny):
    """Request n draws ``act``'s seed for call n, whatever shares the engine with it."""
    conv = conversation(2)
    alone = engine_policy(tiny, temperature=1.0, max_new_tokens=8, seed=11)
    first = alone.act(conv, [])
    inner = engine_policy(tiny, temperature=1.0, max_new_tokens=8, seed=11)
    with BatchedPolicy(inner) as policy:
        assert policy.act(conv, []).token_ids == first.token_ids
    assert inner._calls == 1


def test_weights_updated_mid_turn_tag_the_tokens_after(tiny):
    inner = engine_policy(tiny, max_new_tokens=40)
    at_five, updated = threading.Event(), threading.Event()

    def after(n, outs):
        if n == 5:  # five tokens sampled (prefill gave the first)
            at_five.set()
            assert updated.wait(30)

    spy_steps(inner.engine, after)
    with BatchedPolicy(inner) as policy:
        outs, threads = in_threads(policy, [conversation(2)])
        assert at_five.wait(60)
        policy.policy.update_weights(tiny[0].state_dict(), version=7)  # as rl/actor.py sync_weights does
        updated.set()
        join(threads)
        [out] = outs
        assert policy.policy_version == 7
    n = len(out.token_ids)
    assert n > 5 and out.policy_versions == [0] * 5 + [7] * (n - 5) and out.policy_version == 0


def test_a_prompt_that_does_not_fit_fails_only_its_caller(tiny):
    inner = engine_policy(tiny, max_new_tokens=8)
    with BatchedPolicy(inner) as policy:
        outs, threads = in_threads(policy, [conversation(1), conversation(200), conversation(3)])
        join(threads)
    assert isinstance(outs[1], ContextLengthError)
    assert all(len(o.token_ids) == 8 for o in (outs[0], outs[2]))


def test_a_failed_step_fails_the_requests_in_flight_and_the_worker_goes_on(tiny):
    inner = engine_policy(tiny, max_new_tokens=8)
    real, broken = inner.engine.step, threading.Event()

    def step():  # fails once all three requests are in the engine
        if not broken.is_set():
            return real()
        st = inner.engine.stats()
        if st["running"] + st["waiting"] < 3:
            time.sleep(0.01)  # not stepped: the worker goes round and adds the late ones
            return []
        broken.clear()
        raise RuntimeError("device lost")

    inner.engine.step = step
    broken.set()
    with BatchedPolicy(inner) as policy:
        outs, threads = in_threads(policy, [conversation(1), conversation(2), conversation(3)])
        join(threads)
        for e in outs:
            assert isinstance(e, BatchGenerationError) and "device lost" in str(e) and e.__cause__ is not None
        assert len(policy.act(conversation(1), []).token_ids) == 8  # the next request is served
    assert inner.engine.stats()["kv_blocks_used"] == 0  # the failed requests were aborted


def test_a_request_the_engine_refuses_fails_alone(tiny):
    inner = engine_policy(tiny, max_new_tokens=4)
    inner.temperature = -1.0  # past the constructor's check: add_request rejects it
    with BatchedPolicy(inner) as policy:
        outs, threads = in_threads(policy, [conversation(1), conversation(2)])
        join(threads)
        assert all(isinstance(e, BatchGenerationError) and "temperature" in str(e) for e in outs)
        inner.temperature = 0
        assert len(policy.act(conversation(1), []).token_ids) == 4


def test_close_with_requests_pending_finishes_them(tiny):
    inner = engine_policy(tiny, max_new_tokens=30)
    go = threading.Event()
    spy_steps(inner.engine, lambda n, outs: go.wait(60))  # the worker holds after its first step
    policy = BatchedPolicy(inner, max_batch=2)
    outs, threads = in_threads(policy, [conversation(i) for i in range(1, 6)])

    def submitted() -> int:  # in the engine (held still by the spy) or queued
        st = inner.engine.stats()
        return st["running"] + st["waiting"] + len(policy._pending)

    deadline = time.monotonic() + 60
    while submitted() < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert submitted() == 5 and len(policy._pending) >= 3
    go.set()
    policy.close()  # every request is answered and none hangs
    join(threads)
    assert all(not isinstance(o, Exception) and len(o.token_ids) == 30 for o in outs), [o if isinstance(o, Exception) else (len(o.token_ids), o.finish_reason) for o in outs]
    with pytest.raises(RuntimeError, match="closed"):
        policy.act(conversation(1), [])
