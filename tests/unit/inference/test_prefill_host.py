"""The host side of a prefill step, against per-token definitions: ``ModelRunner._prefill_inputs``
(token ids, positions, KV slots, block tables), ``PrefillLayout.fill`` (the prefill graphs'
input buffer, refilled in place step after step), and the prefix-cache lookup of a long
agent history (``BlockManager.allocate``: chained hashes, tokens verified on every hit)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from opencomposer.inference.block_manager import BlockManager
from opencomposer.inference.engine import Engine
from opencomposer.inference.model_runner import PREFILL_GRAPH_SEQS, PREFILL_GRAPH_TOKENS
from opencomposer.inference.scheduler import ScheduledBatch
from opencomposer.inference.sequence import SamplingParams, Sequence

BS = 4


def _seq(rid: str, length: int, computed: int, rng: random.Random) -> Sequence:
    seq = Sequence(rid, [rng.randrange(3, 97) for _ in range(length)], SamplingParams())
    seq.block_table = rng.sample(range(200), -(-length // BS))
    seq.num_computed = computed
    return seq


def _batch(rng: random.Random) -> ScheduledBatch:
    """Fresh, cached-prefix (mid-block and block-aligned), and a chunk that does not sample."""
    seqs = [_seq("a", 9, 0, rng), _seq("b", 23, 6, rng), _seq("c", 40, 12, rng), _seq("d", 30, 8, rng)]
    return ScheduledBatch(decode=False, seqs=seqs, chunks=[9, 17, 28, 10])


def _reference_inputs(batch: ScheduledBatch):
    ids, pos, slots, last, spans, start = [], [], [], [], [], 0
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.chunks)):
        c = seq.num_computed
        for t in range(c, c + n):
            ids.append(seq.token_ids[t])
            pos.append(t)
            slots.append(seq.block_table[t // BS] * BS + t % BS)
        spans.append((start, n, c, seq.block_table[:-(-(c + n) // BS)]))
        start += n
        if batch.samples(i):
            last.append(start - 1)
    return ids, pos, slots, last, spans


@pytest.fixture(name="runner")
def _runner(tiny_hf):
    return Engine(tiny_hf("qwen2"), None, max_model_len=128, block_size=BS, max_num_seqs=4).runner


def test_prefill_inputs_match_the_per_token_definition(runner):
    batch = _batch(random.Random(0))
    ids, pos, slots, last, spans = runner._prefill_inputs(batch)
    want = _reference_inputs(batch)
    assert ids.tolist() == want[0] and pos.tolist() == want[1] and slots.tolist() == want[2]
    assert ids.dtype == pos.dtype == slots.dtype == np.int64
    assert last == want[3] == [8, 25, 53]  # "d" is a chunk that ends before its last token
    assert [(s, n, c, t.tolist()) for s, n, c, t in spans] == want[4]


def _reference_buffer(lay, w: int, scratch: int, inputs, seqs, tiles) -> list[int]:
    """The graph buffer of a step, entry by entry, from what each input means."""
    ids, pos, slots, last, spans = inputs
    t_max, s_max = max(PREFILL_GRAPH_TOKENS), PREFILL_GRAPH_SEQS
    out = []
    out += [ids[i] if i < len(ids) else 0 for i in range(t_max)]
    out += [pos[i] if i < len(pos) else 0 for i in range(t_max)]
    out += [slots[i] if i < len(slots) else scratch * BS for i in range(t_max)]  # padding -> scratch block
    for s in range(s_max + 1):
        table = spans[s][3] if s < len(spans) else []
        out += [table[j] if j < len(table) else scratch for j in range(w)]
    for row in range(3):
        out += [seqs[row][s] if s < len(seqs[0]) else 0 for s in range(s_max + 1)]  # padding sequence: no tokens
    out += [tiles[0][p] if p < len(tiles[0]) else s_max for p in range(lay.max_tiles)]  # unused tiles: padding seq
    out += [tiles[1][p] if p < len(tiles[1]) else 0 for p in range(lay.max_tiles)]
    out += [last[i] if i < len(last) else 0 for i in range(s_max)]
    return out


def test_layout_fill_matches_the_definition_and_leaves_nothing_of_the_step_before(runner):
    pytest.importorskip("triton")
    from opencomposer.inference.model_runner import PrefillLayout
    from opencomposer.inference.triton_prefill import block_m

    group, scratch, w = runner.group, runner.scratch_block, runner.max_blocks_per_seq
    lay = PrefillLayout(w, group, scratch, BS)
    assert lay.total == sum(size for _, size in lay.offsets.values())
    lay.host[:] = -7  # garbage: fill must not depend on what was there
    big = _batch(random.Random(1))
    small = ScheduledBatch(decode=False, seqs=[_seq("e", 11, 4, random.Random(2))], chunks=[7])
    for batch in (big, small, big):  # refilled in place, as the runner does every step
        inputs = runner._prefill_inputs(batch)
        ids, pos, slots, last, spans = inputs
        bucket = next(t for t in PREFILL_GRAPH_TOKENS if t >= len(ids))
        rows = block_m(bucket, group)
        tiles, seqs = runner._tiles(spans, rows)
        assert tiles[0] == [i for i, (_, n, _, _) in enumerate(spans) for _ in range(-(-n * group // rows))]
        lay.fill(ids, pos, slots, last, [sp[3] for sp in spans], seqs, tiles)
        assert lay.host.tolist() == _reference_buffer(lay, w, scratch, _reference_inputs(batch), seqs, tiles)
        assert lay.host_tensor.tolist() == lay.host.tolist()  # the tensor the runner copies is the same memory


def test_a_long_history_hits_every_full_block_with_the_chained_hashes():
    rng = random.Random(3)
    bm = BlockManager(num_blocks=400, block_size=16)
    history = Sequence("h", [rng.randrange(50_000) for _ in range(3000)], SamplingParams())
    assert bm.allocate(history) and history.num_computed == 0
    history.num_computed = len(history)
    bm.publish(history)
    blocks = list(history.block_table)
    bm.free_seq(history)  # a finished turn: its blocks stay cached
    turn = Sequence("t", history.token_ids + [rng.randrange(50_000) for _ in range(208)], SamplingParams())
    assert bm.allocate(turn)
    full = 3000 // 16
    assert turn.num_computed == full * 16 and turn.block_table[:full] == blocks[:full]
    parent, want = None, []
    for i in range(full):
        parent = BlockManager.chain_hash(parent, tuple(turn.token_ids[i * 16:(i + 1) * 16]))
        want.append(parent)
    assert turn.block_hashes == want
    assert len(turn.block_table) == -(-len(turn) // 16) and bm.num_used == len(turn.block_table)
    turn.num_computed = len(turn)
    bm.publish(turn)
    assert len(turn.block_hashes) == len(turn) // 16
    bm.free_seq(turn)
    assert bm.num_used == 0


class _WeakHashes(BlockManager):
    """Chained hashes of each block's token sum: different blocks of equal sums collide."""

    @staticmethod
    def chain_hash(parent, tokens):
        return hash((parent, sum(tokens)))


def test_a_hash_collision_never_reuses_a_block_of_other_tokens():
    """The hash only finds a candidate block; its tokens are compared too."""
    bm = _WeakHashes(num_blocks=64, block_size=4)
    a = Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], SamplingParams())
    bm.allocate(a)
    a.num_computed = len(a)
    bm.publish(a)
    bm.free_seq(a)
    other_first = Sequence("b", [4, 3, 2, 1, 5, 6, 7, 8, 9], SamplingParams())  # first block collides
    assert bm.allocate(other_first) and other_first.num_computed == 0
    other_second = Sequence("c", [1, 2, 3, 4, 8, 7, 6, 5, 9], SamplingParams())  # second block collides
    assert bm.allocate(other_second) and other_second.num_computed == 4
    same = Sequence("d", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 0], SamplingParams())
    assert bm.allocate(same) and same.num_computed == 12
    for seq in (other_first, other_second, same):
        bm.free_seq(seq)
    assert bm.num_used == 0


def _lookup(bm: BlockManager, tokens: list[int]) -> tuple[list[int], list[int]]:
    """The prefix-cache lookup by its definition: chained hashes, block by block, tokens checked."""
    bs, parent, hits, hashes = bm.block_size, None, [], []
    for i in range((len(tokens) - 1) // bs):
        block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
        h = bm.chain_hash(parent, block_tokens)
        b = bm.cached.get(h)
        if b is None or bm.block_tokens[b] != block_tokens:
            break
        hits.append(b)
        hashes.append(h)
        parent = h
    return hits, hashes


@pytest.mark.parametrize("seed", range(4))
def test_allocation_hits_exactly_what_the_lookup_definition_finds(seed):
    """Agents taking turns (each prompt = its history + new tokens), rollouts branching from a
    shared prompt, twin sequences computing the same blocks, a cache small enough to evict
    all the time, weight updates: every allocation hits the blocks the block-by-block lookup
    finds, and no block leaks."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=48, block_size=4)
    system = [rng.randrange(1, 9) for _ in range(6)]  # shared by every agent; small vocabulary: repeats
    histories = [list(system) for _ in range(5)]
    for step in range(400):
        agent = rng.randrange(len(histories))
        base = histories[agent] if rng.random() < 0.8 else histories[rng.randrange(len(histories))][:rng.randrange(1, 40)]
        prompt = base + [rng.randrange(1, 9) for _ in range(rng.randrange(1, 14))]
        if rng.random() < 0.02:
            bm.invalidate()
        want_hits, want_hashes = _lookup(bm, prompt)
        seq = Sequence(str(step), prompt, SamplingParams())
        if not bm.allocate(seq):
            continue
        assert seq.block_table[:len(want_hits)] == want_hits and seq.block_hashes == want_hashes
        assert seq.num_computed == 4 * len(want_hits)
        twin = Sequence(f"{step}-twin", prompt, SamplingParams())  # same prompt, computed alongside
        if rng.random() < 0.3 and bm.allocate(twin):
            assert twin.block_table[:len(want_hits)] == want_hits
            for s in (seq, twin):  # the twin publishes second: its blocks are cached already
                s.num_computed = len(s)
                bm.publish(s)
            bm.free_seq(seq)
            seq = twin
        seq.num_computed = len(seq)
        bm.publish(seq)
        for _ in range(rng.randrange(0, 9)):  # decode a few tokens
            if not bm.can_append(seq):
                break
            seq.token_ids.append(rng.randrange(1, 9))
            bm.append_slot(seq)
            seq.num_computed += 1
            bm.publish(seq)
        histories[agent] = list(seq.token_ids) if len(seq) < 70 else list(system)  # else a new episode
        bm.free_seq(seq)
        assert bm.num_used == 0
