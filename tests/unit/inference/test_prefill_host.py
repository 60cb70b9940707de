"""The host side of a prefill step, against per-token definitions: ``ModelRunner._prefill_inputs``
(token ids, positions, KV slots, block tables), ``PrefillLayout.fill`` (the prefill graphs'
input buffer, refilled in place step after step), and the prefix-cache lookup of a long
agent history (``BlockManager.allocate``: chained hashes, tokens verified on every hit)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from opencomposer.inference.engine.block_manager import BlockManager
from opencomposer.inference.engine.core import Engine
from opencomposer.inference.engine.prefill_layout import (
    PREFILL_GRAPH_SEQS,
    PREFILL_GRAPH_TOKENS,
)
from opencomposer.inference.engine.scheduler import ScheduledBatch
from opencomposer.inference.engine.sequence import SamplingParams, Sequence

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
    from opencomposer.inference.engine.prefill_layout import PrefillLayout
    from opencomposer.inference.kernels.prefill import tile_for

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
        rows = tile_for(bucket, group).rows
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


class _CountedHashes(BlockManager):
    """Counts the chained hashes it computes."""

    count = 0

    def chain_hash(self, parent, tokens):
        self.count += 1
        return BlockManager.chain_hash(parent, tokens)


def test_a_turn_after_a_freed_history_hashes_only_its_new_blocks():
    """The next turn of a history takes the remembered line's hashes and hashes only the
    blocks after the line; a sibling rollout (same first prompt) hashes from the deepest mark
    it shares with the line. Once a block the line remembers is handed out again, the lookup
    stops there, as hashing every block does."""
    rng = random.Random(5)
    bm = _CountedHashes(num_blocks=420, block_size=16)
    task = [rng.randrange(50_000) for _ in range(1000)]
    history = Sequence("h", task + [rng.randrange(50_000) for _ in range(2000)], SamplingParams())
    assert bm.allocate(history)
    history.num_computed = len(history)
    bm.publish(history)
    bm.free_seq(history)
    full = 3000 // 16  # 187 blocks: marks at blocks 15, 31, ..., 175
    turn = Sequence("t", history.token_ids + [rng.randrange(50_000) for _ in range(208)], SamplingParams())
    want_hits, want_hashes = _lookup(bm, turn.token_ids)
    bm.count = 0
    assert bm.allocate(turn) and turn.num_computed == full * 16
    assert turn.block_table[:full] == want_hits and turn.block_hashes == want_hashes
    assert bm.count == 1  # only block 187, past the line: the first miss (without lines: all 188)
    sibling = Sequence("s", task + [7] * 300, SamplingParams())
    bm.count = 0
    assert bm.allocate(sibling) and sibling.num_computed == 1000 // 16 * 16
    assert bm.count <= 16 + 1  # from mark 47 (its deepest with the task's tokens) to the first miss
    bm.free_seq(sibling)
    # hand the line's block 100 out again: the lookup must stop there, as hashing finds
    turn.num_computed = len(turn)
    bm.publish(turn)
    bm.free_seq(turn)
    line = next(reversed(bm.lines.values()))  # the turn's
    victim = line.blocks[100]
    filler = Sequence("f", [rng.randrange(50_000, 60_000) for _ in range(16 * (list(bm.free).index(victim) + 1))],
                      SamplingParams())
    assert bm.allocate(filler) and victim in filler.block_table  # handed out (then freed, never computed)
    bm.free_seq(filler)
    again = Sequence("a", history.token_ids + [1] * 50, SamplingParams())
    want_hits, want_hashes = _lookup(bm, again.token_ids)
    assert len(want_hits) == 100
    assert bm.allocate(again) and again.block_table[:100] == want_hits and again.block_hashes == want_hashes


def test_repetitive_prompts_give_up_on_lines_and_still_hit_what_hashing_finds():
    """Lines whose tokens match at every mark but differ before it (a prompt of one repeated
    token after different first tokens): the lookup stops trying lines after a few and hashes."""
    bm = BlockManager(num_blocks=400, block_size=2, line_mark=1)
    for first in range(12):
        seq = Sequence(str(first), [first] + [0] * 41, SamplingParams())
        assert bm.allocate(seq)
        seq.num_computed = len(seq)
        bm.publish(seq)
        bm.free_seq(seq)
    assert len(bm.lines) == 12
    for prompt in ([99] + [0] * 60, [5] + [0] * 60, [5, 0, 0, 1] + [0] * 30):
        want_hits, want_hashes = _lookup(bm, prompt)
        seq = Sequence("p", prompt, SamplingParams())
        assert bm.allocate(seq) and seq.block_table[:len(want_hits)] == want_hits and seq.block_hashes == want_hashes
        # 99: no line, nothing cached; 5 then zeros: line 5's 21 blocks; 5, 0, 0, 1: its first block only
        assert seq.num_computed == 2 * len(want_hits) == (0 if prompt[0] == 99 else 2 * (21 if prompt[3] == 0 else 1))
        bm.free_seq(seq)


class _WeakHashes(BlockManager):
    """Chained hashes of each block's token sum: different blocks of equal sums collide."""

    @staticmethod
    def chain_hash(parent, tokens):
        return hash((parent, sum(tokens)))


@pytest.mark.parametrize("line_mark", [16, 1])
def test_a_hash_collision_never_reuses_a_block_of_other_tokens(line_mark):
    """The hash only finds a candidate block; its tokens are compared too (and a remembered
    line vouches only for the tokens it holds)."""
    bm = _WeakHashes(num_blocks=64, block_size=4, line_mark=line_mark)
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


@pytest.mark.parametrize("max_lines,line_mark", [(0, 16), (256, 2), (3, 1)])
@pytest.mark.parametrize("seed", range(4))
def test_allocation_hits_exactly_what_the_lookup_definition_finds(seed, max_lines, line_mark):
    """Agents taking turns (each prompt = its history + new tokens), rollouts branching from a
    shared prompt, twin sequences computing the same blocks, a cache small enough to evict
    all the time, weight updates: every allocation hits the blocks the block-by-block lookup
    finds, and no block leaks -- without remembered lines, with many found at every other
    block, and with few (evicted all the time) found at every block."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=48, block_size=4, max_lines=max_lines, line_mark=line_mark)
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


def test_key_splits_are_the_fastest_measured_on_an_h100():
    """``splits_for`` against ``profile_engine.py --sweep`` on an H100 (132 SMs): turns of 208
    tokens (1.5B: 40 programs alone, 320 for 8 turns; 0.5B: 46) on short and long histories,
    and long fresh prompts (one split: thousands of programs)."""
    pytest.importorskip("triton")
    from opencomposer.inference.kernels.prefill import splits_for

    fastest = {(40, 3000, 128): 4, (40, 8000, 128): 4, (40, 30000, 128): 16, (40, 60000, 128): 16,
               (320, 3000, 128): 2, (320, 16000, 128): 4, (320, 60000, 128): 4,
               (46, 8000, 64): 8, (46, 30000, 64): 8, (368, 1000, 64): 1, (3072, 16384, 128): 1}
    assert {case: splits_for(*case, sms=132) for case in fastest} == fastest


def test_small_buckets_get_a_graph_for_short_and_one_for_long_histories():
    """``graph_variants``: a 208-token turn's bucket (Qwen2.5-1.5B shape on an H100) is captured
    with 4 splits (3,000-key histories) and 16 (30,000); large buckets with 1 (fresh prompts)
    and more (long histories: the last wave of programs would run nearly empty), with 128-row
    tiles for long histories where a bucket has 4,096 rows or more; one graph where the
    model's context is short; a step replays the captured variant the model prefers for it."""
    pytest.importorskip("triton")
    from opencomposer.inference.kernels.prefill import (
        WIDE,
        Tile,
        graph_variants,
        pick_variant,
        splits_for,
    )

    narrow = Tile(64)
    assert graph_variants(224, 192, 6, 2, 128, 2, 32768, 132) == ((narrow, 4), (narrow, 16))
    assert graph_variants(4096, 3840, 6, 2, 128, 2, 32768, 132) == ((narrow, 1), (WIDE[0], 2))
    # 1: a fresh 3,376-token prompt; 2: on a 4,096-key history; 4: on the longest (128-row tiles)
    assert graph_variants(3584, 3328, 6, 2, 128, 2, 32768, 132) == ((narrow, 1), (narrow, 2), (WIDE[0], 4))
    assert graph_variants(224, 192, 6, 2, 128, 2, 2048, 132) == ((narrow, 4),)  # a short max_model_len: one graph
    # fp32 and head_dim 64 keep 64-row tiles (the 128-row ones would not fit / measured no faster)
    assert {t for t, _ in graph_variants(4096, 3840, 6, 2, 128, 4, 32768, 132)} == {narrow}
    assert {t for t, _ in graph_variants(4096, 3840, 7, 2, 64, 2, 32768, 132)} == {narrow}
    # every bucket's variants, as the runner captures them (each bucket above the one below it)
    from opencomposer.inference.engine.prefill_layout import (
        PREFILL_GRAPH_TOKENS,
        bucket_variants,
    )

    variants = bucket_variants(PREFILL_GRAPH_TOKENS, 6, 2, 128, 2, 32768, 132)
    assert list(variants) == list(PREFILL_GRAPH_TOKENS)
    assert variants[224] == ((narrow, 4), (narrow, 16)) and variants[4096] == ((narrow, 1), (WIDE[0], 2))
    # from the 768-token bucket up (4,608 rows) the long-history graph has 128-row tiles
    assert [t for t, v in variants.items() if any(tile == WIDE[0] for tile, _ in v)] == \
        [t for t in PREFILL_GRAPH_TOKENS if t >= 768]
    assert [splits_for(40, keys, 128, 132, among=(4, 16)) for keys in (1000, 3000, 16000, 30000, 60000)] == \
        [4, 4, 4, 16, 16]
    # 8 turns (320 programs) on 30,000 keys in a bucket captured with 2 and 8 (measured: 4 would
    # be 910 us, 8 942, 2 1,057): the model takes 8
    assert splits_for(320, 30000, 128, 132) == 4 and splits_for(320, 30000, 128, 132, among=(2, 8)) == 8
    # 8 turns of 208 tokens in the 1,792-token bucket: 64-row tiles on 3,000 keys, 128-row tiles
    # with 8 splits (the fastest measured, 824 us against 919 with 64 rows) on 30,000
    v = variants[1792]
    assert pick_variant(v, 1792, [208] * 8, 6, 2, 128, 2, 3000, 132)[0] == narrow
    assert pick_variant(v, 1792, [208] * 8, 6, 2, 128, 2, 30000, 132) == (WIDE[0], 8)
    # a 65,536-token engine: the bucket also has a 128-row graph for 16,000 keys (8 splits),
    # which 8 turns on 30,000 keys take (835 us against 907 with the 16 of 65,536 keys', H100)
    v = bucket_variants(PREFILL_GRAPH_TOKENS, 6, 2, 128, 2, 65536, 132)[1792]
    assert v == ((narrow, 2), (narrow, 4), (WIDE[0], 8), (WIDE[0], 16))
    assert pick_variant(v, 1792, [208] * 8, 6, 2, 128, 2, 30000, 132) == (WIDE[0], 8)
    # groups on 8,000 keys: the buckets' graphs for 8,192 keys give them 4 splits (H100, us per
    # layer: 4 turns 164 against 202 with the 1 split of 4,096 keys'; 8 turns 281 against 301 with 2)
    assert pick_variant(variants[896], 896, [208] * 4, 6, 2, 128, 2, 8000, 132) == (narrow, 4)
    assert pick_variant(variants[1792], 1792, [208] * 8, 6, 2, 128, 2, 8000, 132) == (narrow, 4)


def test_tile_for_takes_128_rows_for_long_histories_and_long_steps():
    """``tile_for``: 128-row tiles with 128-key tiles and 8 warps for steps of >= 8,192 tokens;
    with 64-key tiles and 4 warps for shorter steps of >= 4,096 (token, head) rows on >= 16,000
    keys; else by size (16, 32, 64); never for fp32 or head_dim 64."""
    pytest.importorskip("triton")
    from opencomposer.inference.kernels.prefill import WIDE, Tile, tile_for

    assert tile_for(208 * 8, 6, 128, 2, 30000) == WIDE[0]
    assert tile_for(208, 6, 128, 2, 60000) == Tile(64)  # one turn: 1,248 rows
    assert tile_for(208 * 8, 6, 128, 2, 12000) == Tile(64)  # a group on a short history
    assert tile_for(7000, 6, 128, 2, 30000) == WIDE[0]  # a chunk on a long history
    assert tile_for(8192, 6, 128, 2, 8192) == WIDE[1] and tile_for(16384, 6, 128, 2, 16384) == WIDE[1]
    assert tile_for(8192, 6, 128, 2, 30000) == WIDE[1]  # long steps keep theirs on any history
    assert tile_for(8192, 6, 128, 4, 30000) == Tile(64) and tile_for(8192, 7, 64, 2, 30000) == Tile(64)
    assert [tile_for(n, 6, 128, 2).rows for n in (1, 2, 5, 6, 100)] == [16, 16, 32, 64, 64]
