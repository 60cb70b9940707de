"""Paged attention on the CPU equals plain causal attention over the whole sequence: prefill
(fresh and over a cached prefix) and decode, with grouped-query heads and scattered blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opencomposer.inference.models.attention import (
    AttentionBatch,
    PrefillSeq,
    paged_attention,
)

H, KVH, D, BLOCK, BLOCKS = 4, 2, 8, 4, 8
TABLE = torch.tensor([5, 2, 7])  # the sequence's blocks: deliberately neither first nor in order


def slots(positions: range) -> torch.Tensor:
    return torch.tensor([int(TABLE[i // BLOCK]) * BLOCK + i % BLOCK for i in positions])


def reference(q, k, v) -> torch.Tensor:
    """[T, H, d] causal attention over all T tokens, K/V heads repeated for their query heads."""
    kk = k.transpose(0, 1).repeat_interleave(H // KVH, dim=0)
    vv = v.transpose(0, 1).repeat_interleave(H // KVH, dim=0)
    return F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True).transpose(0, 1)


def test_prefill_then_cached_prefill_then_decode_match_full_attention() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, n, D, generator=g) for n in (H, KVH, KVH))
    want = reference(q, k, v)
    k_cache, v_cache = torch.zeros(BLOCKS, BLOCK, KVH, D), torch.zeros(BLOCKS, BLOCK, KVH, D)

    first = range(6)  # nothing cached: the fresh, right-padded causal batch
    fresh = AttentionBatch(slots(first), decode=False, fresh_index=torch.arange(6)[None, :],
                           fresh_valid=torch.ones(1, 6, dtype=torch.bool), fresh_rows=torch.arange(6))
    got = paged_attention(q[:6], k[:6], v[:6], k_cache, v_cache, fresh)
    torch.testing.assert_close(got, want[:6])

    more = range(6, 9)  # three new tokens over the six cached ones
    cached = AttentionBatch(slots(more), decode=False, prefill=[PrefillSeq(0, 3, 9, TABLE)])
    got = paged_attention(q[6:9], k[6:9], v[6:9], k_cache, v_cache, cached)
    torch.testing.assert_close(got, want[6:9])

    step = AttentionBatch(slots(range(9, 10)), decode=True, block_tables=TABLE[None, :],
                          context_lens=torch.tensor([10]))
    got = paged_attention(q[9:], k[9:], v[9:], k_cache, v_cache, step)
    torch.testing.assert_close(got, want[9:])
