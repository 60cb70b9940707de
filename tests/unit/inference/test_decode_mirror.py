"""The CPU decode mirror (``inference/engine/decode_mirror.py``): the engine decodes the same tokens
with the same logprobs through it as through the block gathers, in every way sequences come
and go (joining mid-run, finishing out of order, preemption, growth past its capacity); and
the mirror itself holds exactly each sequence's cached K/V, in its slot, after every move."""

from __future__ import annotations

import pytest
import torch

from opencomposer.inference.engine.decode_mirror import DecodeMirror
from opencomposer.inference.engine.core import Engine, SamplingParams


@pytest.fixture
def hf(tiny_hf):
    return tiny_hf("qwen2")


def _both(hf, run, budget=None, **engine_kw):
    """``run(engine)`` -> completions, with the mirror (the CPU default; ``budget``: its bytes)
    and with gathers."""
    out = {}
    for mirrored in (True, False):
        engine = Engine(hf, None, **engine_kw)
        assert engine.runner.mirror is not None  # on by default on the CPU
        if budget is not None:
            engine.runner.mirror.budget = budget
        if not mirrored:
            engine.runner.mirror = None
        out[mirrored] = (run(engine), engine)
    return out


def _same(a, b):
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5


# the tiny model's K and V take 512 bytes a position and slot: room for 3 slots of 128 positions,
# so when 4 sequences decode at once the step goes through the gathers, and back after
@pytest.mark.parametrize("budget", [None, 3 * 128 * 512])
def test_ragged_finishes_and_joins_mid_run_match_the_gather_path(hf, prompts, budget):
    ps = prompts(5, seed=21)
    lengths = [3, 14, 6, 20, 9]  # finish out of order: slots are handed on, rows permuted

    def run(engine):
        rids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(ps[:3], lengths)]
        for _ in range(4):
            engine.step()
        rids += [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0))
                 for p, n in zip(ps[3:], lengths[3:])]
        while engine.has_unfinished():
            engine.step()
        return [engine.completion(r) for r in rids]

    steps = []

    def watch(engine):  # each decode step's size, and whether the mirror took it
        mirror = engine.runner.mirror
        if mirror is not None:
            step = mirror.step

            def recorded(seqs, *caches):
                steps.append((len(seqs), step(seqs, *caches)))
                return steps[-1][1]

            mirror.step = recorded
        return run(engine)

    out = _both(hf, watch, budget, max_num_seqs=4, max_model_len=128, block_size=4)
    _same(out[True][0], out[False][0])
    engine = out[True][1]
    assert engine.runner.mirror.slots == {} and engine.stats()["kv_blocks_used"] == 0
    used = [n for n, view in steps if view is not None]
    over = [n for n, view in steps if view is None]
    assert 4 in used if budget is None else (max(used) == 3 and set(over) == {4})


def test_preemption_and_sampling_match_the_gather_path(hf, prompts):
    ps = prompts(4, lo=20, hi=30, seed=7)
    params = [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=24, temperature=0.9, seed=4),
              SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=24, top_k=5, seed=2)]
    out = _both(hf, lambda e: e.generate(ps, params), max_model_len=64, block_size=4, kv_blocks=26)
    _same(out[True][0], out[False][0])
    assert out[True][1].stats()["preemptions"] > 0


@pytest.fixture
def nan_filled_memory():
    """Uninitialised tensors (torch.empty) come filled with NaN: SDPA reads the masked positions
    past each context too, so the mirror must not leave them uninitialised (0 x NaN is NaN)."""
    old = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(old[0])
    torch.utils.deterministic.fill_uninitialized_memory = old[1]


def test_growing_past_the_capacity_keeps_every_token(hf, prompts, nan_filled_memory):
    # three short prompts: the mirror starts with 3 slots of 256 positions; a 300-token one joins
    ps = prompts(4, lo=25, hi=26, seed=3)
    ps[3] = ps[3] * 12

    def run(engine):
        rids = [engine.add_request(p, SamplingParams(max_tokens=8, temperature=0)) for p in ps[:3]]
        for _ in range(3):
            engine.step()
        rids.append(engine.add_request(ps[3], SamplingParams(max_tokens=8, temperature=0)))
        while engine.has_unfinished():
            engine.step()
        return [engine.completion(r) for r in rids]

    out = _both(hf, run, max_num_seqs=4, max_model_len=512, block_size=16)
    _same(out[True][0], out[False][0])
    assert out[True][1].runner.mirror.k.shape[1::2] == (4, 512)


class _Seq:
    """What the mirror reads of a sequence: its length and block table."""

    def __init__(self, n: int, table: list[int]):
        self.n, self.block_table = n, table

    def __len__(self):
        return self.n


def test_the_mirror_holds_each_sequence_in_its_slot_after_moves():
    layers, blocks, bs, kvh, d = 2, 12, 4, 2, 3
    k_cache = torch.randn(layers, blocks, bs, kvh, d)
    v_cache = torch.randn(layers, blocks, bs, kvh, d)
    mirror = DecodeMirror(layers, kvh, d, torch.float32, max_len=64, budget=1 << 20)

    def expect(s):  # the sequence's first len - 1 tokens from the paged cache, head-major
        idx = torch.tensor(s.block_table)
        return (k_cache[:, idx].reshape(layers, -1, kvh, d)[:, :len(s) - 1].transpose(1, 2),
                v_cache[:, idx].reshape(layers, -1, kvh, d)[:, :len(s) - 1].transpose(1, 2))

    a, b, c = _Seq(6, [3, 7]), _Seq(9, [1, 0, 5]), _Seq(4, [9])
    view = mirror.step([a, b, c], k_cache, v_cache)
    assert view.order is None and view.width == 9 and view.slot.tolist() == [0, 1, 2]
    assert view.pos.tolist() == [5, 8, 3]
    for s in (a, b, c):
        k, v = expect(s)
        i = mirror.slots[s]
        assert torch.equal(mirror.k[:, i, :, :len(s) - 1], k) and torch.equal(mirror.v[:, i, :, :len(s) - 1], v)
    # a leaves: c moves into slot 0; b and c keep their tokens; this step's rows are (b, c)
    b.n, c.n = 10, 5  # one token further each (the step before wrote their newest in place)
    mirror.k[:, 1, :, 8] = 7.0  # stands for the token the last step wrote for b
    view = mirror.step([b, c], k_cache, v_cache)
    assert mirror.slots == {b: 1, c: 0}
    assert view.slot.tolist() == [1, 0] and view.order.tolist() == [1, 0]  # slot 0 holds row 1 (c)
    assert view.pos.tolist() == [9, 4]
    assert torch.equal(view.mask[:, 0, 0].isfinite(), torch.tensor([[True] * 5 + [False] * 5, [True] * 10]))
    assert torch.equal(mirror.k[:, 1, :, 8], torch.full((layers, kvh, d), 7.0))  # kept, not re-copied
    k, _ = expect(_Seq(4, [9]))
    assert torch.equal(mirror.k[:, 0, :, :3], k)
    # a count that does not match (here: b recomputed elsewhere) is copied afresh from the cache
    b.n = 12
    b.block_table = [1, 0, 5]
    mirror.step([b], k_cache, v_cache)
    k, v = expect(b)
    assert mirror.slots == {b: 0} and torch.equal(mirror.k[:, 0, :, :11], k)
    mirror.forget([b])
    assert mirror.slots == {} and mirror.held == {}
    assert mirror.k.isfinite().all()
    # over the budget: nothing held, the caller gathers (room for 3 slots of 64 positions, max_len)
    mirror.budget = 3 * 64 * 2 * layers * kvh * d * 4
    seqs = [_Seq(5, [1, 2]) for _ in range(4)]
    assert mirror.step(seqs, k_cache, v_cache) is None and mirror.slots == {} and mirror.k.numel() == 0
    assert mirror.step(seqs[:3], k_cache, v_cache) is not None and mirror.k.shape[1::2] == (3, 64)
