"""Run-ahead decode (the engine launches step N+1 before reading step N's tokens) on CPU:
``cuda_graphs="eager"`` runs the decode graphs' bodies eagerly on their static buffers, so
the same code path as on CUDA runs here. Every scenario is run with run-ahead on and off and
must give the same tokens, logprobs, finish reasons and policy versions; every test ends
with no KV block in use."""

from __future__ import annotations

import time

import pytest
import torch

from opencomposer.inference.engine.core import Engine, SamplingParams


@pytest.fixture
def hf(tiny_hf):
    return tiny_hf("qwen2")


def _engine(hf, run_ahead: bool, **kw) -> Engine:
    kw = {"max_model_len": 128, "block_size": 4, **kw}
    return Engine(hf, None, cuda_graphs="eager", run_ahead=run_ahead, **kw)


def _same(a, b) -> None:
    """Completions ``a`` (run-ahead) and ``b`` (without) are the same."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        assert x.policy_versions == y.policy_versions
        assert x.cached_prompt_tokens == y.cached_prompt_tokens
        assert len(x.logprobs) == len(y.logprobs) == len(x.token_ids)
        assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0.0) < 1e-4


def _both(hf, run, **kw):
    """``run(engine)`` -> completions, with run-ahead on and off; -> (on, off, engines)."""
    engines = {ra: _engine(hf, ra, **kw) for ra in (True, False)}
    outs = {ra: run(e) for ra, e in engines.items()}
    _same(outs[True], outs[False])
    for e in engines.values():
        assert e.stats()["kv_blocks_used"] == 0 and not e.has_unfinished()
    return outs[True], outs[False], engines


def test_greedy_outputs_are_identical_and_steps_run_ahead(hf, prompts):
    ps = prompts(5, seed=21)
    params = [SamplingParams(max_tokens=k, temperature=0) for k in (1, 2, 9, 23, 14)]
    on, _, engines = _both(hf, lambda e: e.generate(ps, params) + e.generate(ps[:1], params[3]))
    s_on, s_off = engines[True].stats(), engines[False].stats()
    assert [len(c.token_ids) for c in on[:5]] == [1, 2, 9, 23, 14]
    assert s_on["run_ahead"] and not s_off["run_ahead"]
    assert s_on["generated_tokens"] == s_off["generated_tokens"] == 1 + 2 + 9 + 23 + 14 + 23
    assert s_on["steps"] == s_off["steps"]
    # every decode step but the last of each run (no budget for one more) and the steps
    # right after a sequence leaves the batch can run ahead
    assert s_on["run_ahead_steps"] >= 20 and s_off["run_ahead_steps"] == 0
    assert s_on["run_ahead_discarded_rows"] == 0  # only max_tokens ends these: never run past it
    assert s_on["cuda_graph_batch_sizes"] == [1, 2, 4, 8, 16, 32, 48, 64]


def test_stop_token_mid_batch_discards_the_row_launched_ahead(hf, prompts):
    ps = prompts(3, seed=22)
    free = _engine(hf, False).generate(ps, SamplingParams(max_tokens=16, temperature=0))
    stop = free[1].token_ids[4]
    params = [SamplingParams(max_tokens=16, temperature=0),
              SamplingParams(max_tokens=16, temperature=0, stop_token_ids=(stop,)),
              SamplingParams(max_tokens=12, temperature=0)]
    on, _, engines = _both(hf, lambda e: e.generate(ps, params))
    cut = free[1].token_ids.index(stop) + 1
    assert on[1].finish_reason == "stop" and on[1].token_ids == free[1].token_ids[:cut]
    assert on[0].token_ids == free[0].token_ids and on[2].token_ids == free[2].token_ids[:12]
    s = engines[True].stats()
    assert s["run_ahead_discarded_rows"] >= 1
    assert s["generated_tokens"] == 16 + cut + 12 == engines[False].stats()["generated_tokens"]


def test_abort_while_a_step_is_in_flight(hf, prompts):
    ps = prompts(3, seed=23)
    params = SamplingParams(max_tokens=30, temperature=0)

    def run(e):
        rids = [e.add_request(p, params) for p in ps]
        for _ in range(6):
            e.step()
        if e.run_ahead:
            assert e.stats()["run_ahead_in_flight"]
        e.abort(rids[1])
        outs = e.step()
        assert [o.finish_reason for o in outs if o.request_id == rids[1]] == ["abort"]
        for _ in range(4):
            e.step()
        e.abort(rids[0])
        e.abort(rids[2])  # nothing left running, one step still in flight
        while e.has_unfinished():
            e.step()
        return [e.completion(r) for r in rids]

    on, _, engines = _both(hf, run)
    assert [c.finish_reason for c in on] == ["abort"] * 3
    assert [len(c.token_ids) for c in on] == [11, 6, 11]  # prefill makes the first token
    s = engines[True].stats()
    assert s["run_ahead_discarded_rows"] >= 1 + 2  # rids[1]'s row, then the last step's
    assert not s["run_ahead_in_flight"]


def test_weight_update_between_steps_tags_versions_like_without_run_ahead(hf, tiny_hf, prompts):
    other = tiny_hf("qwen2", seed=1)
    ps = prompts(2, seed=24)
    params = SamplingParams(max_tokens=12, temperature=0)

    def run(e):
        rids = [e.add_request(p, params) for p in ps]
        for _ in range(5):  # prefill, then 4 decode steps
            e.step()
        e.update_weights(other.state_dict(), version=3)
        while e.has_unfinished():
            e.step()
        return [e.completion(r) for r in rids]

    on, _, engines = _both(hf, run)
    for c in on:
        assert c.policy_versions == [0] * 5 + [3] * 7
    # the step launched ahead ran on the old weights: dropped, recomputed on the new ones
    assert engines[True].stats()["run_ahead_discarded_rows"] == 2


def test_prefix_cache_hits_after_a_run_ahead_run(hf, prompts):
    history = prompts(1, lo=30, hi=31, seed=25)[0]

    def run(e):
        first = e.generate([history], SamplingParams(max_tokens=13, temperature=0))[0]
        turn2 = history + first.token_ids + [5, 6, 7]
        return [first, e.generate([turn2], SamplingParams(max_tokens=8, temperature=0))[0]]

    on, _, _ = _both(hf, run)
    assert on[0].cached_prompt_tokens == 0
    assert on[1].cached_prompt_tokens == (30 + 13 - 1) // 4 * 4 > 0  # the last token's K/V was never computed
    alone = _engine(hf, False).generate([history + on[0].token_ids + [5, 6, 7]],
                                        SamplingParams(max_tokens=8, temperature=0))[0]
    assert on[1].token_ids == alone.token_ids


def test_waiting_requests_and_preemption(hf, prompts):
    ps = prompts(6, lo=20, hi=30, seed=26)
    params = SamplingParams(max_tokens=20, temperature=0)
    # 3 sequences at a time, more queued: run-ahead goes on while the batch is full
    _, _, engines = _both(hf, lambda e: e.generate(ps, params), max_num_seqs=3)
    assert engines[True].stats()["run_ahead_steps"] > 0
    # a cache that holds about two sequences: preemption happens only in schedule(), never ahead
    _, _, engines = _both(hf, lambda e: e.generate(ps[:4], SamplingParams(max_tokens=24, temperature=0)),
                          max_model_len=64, kv_blocks=26)
    assert engines[True].stats()["preemptions"] > 0 and engines[True].stats()["run_ahead_steps"] > 0


def test_sampling_with_temperature_and_rows_that_cannot_run_ahead(hf, prompts):
    ps = prompts(2, seed=27)
    temp = SamplingParams(max_tokens=15, temperature=0.8)

    def sampled(e):
        torch.manual_seed(7)  # one sequence: both modes draw the same noise in the same order
        return e.generate(ps[:1], temp)

    _both(hf, sampled)
    # seeded / top-k / top_logprobs rows sample outside the graph: no run-ahead, same results
    special = [SamplingParams(max_tokens=8, temperature=1.0, seed=3),
               SamplingParams(max_tokens=8, temperature=0.7, top_k=5, seed=4)]
    _, _, engines = _both(hf, lambda e: e.generate(ps, special))
    assert engines[True].stats()["run_ahead_steps"] == 0


def test_bad_options_are_named(hf):
    with pytest.raises(ValueError, match="cuda_graphs='bogus'"):
        Engine(hf, None, max_model_len=64, cuda_graphs="bogus")
    with pytest.raises(ValueError, match="run_ahead=True needs decode graphs"):
        Engine(hf, None, max_model_len=64, cuda_graphs=False, run_ahead=True)
    default = Engine(hf, None, max_model_len=64).stats()  # CPU default: eager decode, no graphs
    assert default["run_ahead"] is False and default["cuda_graph_batch_sizes"] == []


def test_server_loop_streams_the_same_tokens(hf, prompts):
    """The server's stepping thread (``EngineLoop``) over a run-ahead engine: requests that
    arrive while others decode, and one aborted by its reader mid-stream."""
    import asyncio

    from opencomposer.inference.engine.loop import EngineLoop

    ps = prompts(4, seed=28)
    params = [SamplingParams(max_tokens=k, temperature=0) for k in (12, 30, 7, 20)]
    want = [c.token_ids for c in _engine(hf, False).generate(ps, params)]
    engine = _engine(hf, True, max_num_seqs=4)
    loop = EngineLoop(engine, max_pending=8).start()

    async def one(i, abort_after=None):
        await asyncio.sleep(0.002 * i)  # arrive at different steps
        loop.reserve(1)
        group = loop.submit([(ps[i], params[i])])
        got = []
        async for _, out in group:
            got += out.new_token_ids
            if abort_after is not None and len(got) >= abort_after:
                loop.abort(group)
                break
        return got

    async def main():
        return await asyncio.gather(one(0), one(1, abort_after=9), one(2), one(3))

    try:
        got = asyncio.run(main())
        assert got[0] == want[0] and got[2] == want[2] and got[3] == want[3]
        assert got[1] == want[1][:len(got[1])] and len(got[1]) >= 9
        deadline = time.time() + 10
        while loop.pending and time.time() < deadline:
            time.sleep(0.01)
        stats = asyncio.run(_call(loop, engine.stats))
        assert stats["kv_blocks_used"] == 0 and stats["running"] == 0 and not stats["run_ahead_in_flight"]
        assert stats["run_ahead_steps"] > 0
    finally:
        loop.stop()


async def _call(loop, fn):
    return await loop.call(fn)


def test_decode_graph_inputs_written_in_place_match_the_listed_ones(hf, prompts):
    # the graph path's host buffers (numpy, in place) hold what the list-built inputs say, for
    # rows whose next token starts a block, ends one or sits inside one, and padding rows
    engine = _engine(hf, False, max_num_seqs=8)
    for p, n in zip(prompts(3, seed=29), (4, 7, 9)):  # block_size 4: positions at each offset in a block
        engine.add_request(p[:n], SamplingParams(max_tokens=4))
    while engine.scheduler.waiting:
        engine.step()
    batch = engine.scheduler.schedule()
    runner = engine.runner
    bucket = runner.decode_bucket(len(batch.seqs))
    vec, tables = runner._rows_of(batch.seqs, bucket)
    ids, pos, slots, rows, lens = runner._decode_inputs(batch, runner.max_blocks_per_seq, bucket)
    assert vec[:, :bucket].tolist() == [ids, pos, slots, lens] and tables.tolist() == rows
    for s in batch.seqs:
        engine.abort(s.request_id)
    while engine.has_unfinished():
        engine.step()
