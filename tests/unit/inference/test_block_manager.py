"""BlockManager bookkeeping: allocation, prefix reuse by chained block hashes, eviction of
freed-but-cached blocks, invalidation on weight updates; no block leaks."""

from __future__ import annotations

import pytest

from opencomposer.inference.engine.block_manager import BlockManager, NoFreeBlocks
from opencomposer.inference.engine.sequence import SamplingParams, Sequence


def _seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams())


def _computed(bm, seq):
    seq.num_computed = len(seq)
    bm.publish(seq)


def test_allocate_free_and_reuse_of_full_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq(range(10))
    assert bm.allocate(a) and len(a.block_table) == 3 and a.num_computed == 0
    _computed(bm, a)
    assert len(bm.cached) == 2  # two full blocks published; the partial third is not
    b = _seq(list(range(8)) + [50, 51, 52], "b")  # shares the first two blocks
    assert bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed == 8
    assert bm.ref[a.block_table[0]] == 2
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_used == 0 and bm.num_free == 8
    c = _seq(list(range(8)) + [7], "c")  # reuse after both finished: the blocks kept their K/V
    assert bm.allocate(c) and c.num_computed == 8
    bm.free_seq(c)
    assert bm.hit_tokens == 16


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq(range(8))
    bm.allocate(a)
    _computed(bm, a)
    bm.free_seq(a)
    b = _seq(range(8), "b")
    assert bm.allocate(b) and b.num_computed == 4  # the second block is recomputed for its logits


def test_same_block_after_a_different_prefix_is_not_reused():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = _seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    _computed(bm, a)
    b = _seq([9, 9, 3, 4, 5], "b")  # block [3, 4] again, but after another first block
    assert bm.allocate(b) and b.num_computed == 0


def test_not_enough_blocks_changes_nothing_and_eviction_forgets_hashes():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = _seq(range(7))
    assert bm.allocate(a)
    assert not bm.allocate(_seq(range(100, 104), "b"))
    assert bm.num_free == 0
    a.token_ids.append(0)
    bm.append_slot(a)  # the 8th token still fits the last block
    a.token_ids.append(0)
    with pytest.raises(NoFreeBlocks):
        bm.append_slot(a)
    del a.token_ids[-2:]
    _computed(bm, a)
    bm.free_seq(a)
    assert len(bm.cached) == 3
    b = _seq(range(100, 108), "b")  # needs all 4 blocks: evicts every cached prefix
    assert bm.allocate(b) and b.num_computed == 0
    assert bm.cached == {}
    bm.free_seq(b)
    assert bm.num_used == 0


def test_invalidate_drops_the_cache_and_stops_old_sequences_publishing():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = _seq(range(5))
    bm.allocate(a)
    bm.invalidate()
    _computed(bm, a)  # computed partly under the old weights: never published
    assert bm.cached == {}
    bm.free_seq(a)
    b = _seq(range(5), "b")
    assert bm.allocate(b) and b.num_computed == 0
