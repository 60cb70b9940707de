"""Paged attention: write this step's K/V into the block cache, then attend over it.

The KV cache of one layer is ``[num_blocks, block_size, num_kv_heads, head_dim]``; a
sequence owns a list of blocks (its block table) and token ``i`` of it lives in slot
``block_table[i // block_size] * block_size + i % block_size``. ``AttentionBatch`` says,
for one model step, where the new tokens go (``slot_mapping``) and what each sequence
attends to.

This is the portable torch path (gather blocks + SDPA), used on CPU and CUDA. Decode is
fixed-shape (block tables padded to a width, a length mask), so CUDA graphs can capture it.
On the CPU, decode reads the runner's contiguous copy of each sequence's K/V instead when it
holds one (``decode_mirror.py``): no gather in every layer of every step.
Grouped-query attention is done by viewing the query heads of one KV head as that head's
"queries" ([B, kv_heads, group, d]) instead of repeating K/V, which is the same sum.

Test: ``pytest tests/unit/inference/test_attention.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from opencomposer.inference.engine.decode_mirror import MirrorView

_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class PrefillSeq:
    q_start: int          # first row of this sequence in the flat token batch
    q_len: int            # new tokens computed now
    ctx_len: int          # tokens attended to (cached prefix + new)
    block_table: torch.Tensor  # [ceil(ctx_len / block_size)] int64, on the cache's device


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor                # [T] int64: cache slot of each new token
    decode: bool
    block_tables: torch.Tensor | None = None  # decode: [B, W] int64, padded with a valid block
    context_lens: torch.Tensor | None = None  # decode: [B] int64, tokens to attend (new one included)
    prefill: list[PrefillSeq] = field(default_factory=list)  # prefill rows with a cached prefix
    # prefill rows without one, computed together: right-padded to one length, causal
    fresh_index: torch.Tensor | None = None   # [n, L] int64 rows of the flat batch (padding: row 0)
    fresh_valid: torch.Tensor | None = None   # [n, L] bool
    fresh_rows: torch.Tensor | None = None    # [m] int64: the flat rows they fill, in order
    num_tokens: int = 0
    decode_mask: torch.Tensor | None = None   # decode: [B, 1, 1, S] additive mask, built once per step
    triton_decode: bool = False               # decode with the Triton kernel (CUDA) instead of gather + SDPA
    decode_counters: torch.Tensor | None = None  # Triton decode: its split-arrival counters (``paged_decode``)
    # prefill with the Triton paged-prefill kernel (``triton_prefill.py``) when set:
    prefill_tables: torch.Tensor | None = None  # [S, W] int64 block tables of the step's sequences
    prefill_seqs: torch.Tensor | None = None    # [3, S] int64: first flat row, new tokens, context length
    prefill_tiles: torch.Tensor | None = None   # [2, P] int64: sequence and first row of each program
    prefill_tile: tuple | None = None           # the program's shape (``triton_prefill.Tile``)
    prefill_splits: int = 1                     # key splits per program (``triton_prefill.splits_for``)
    kv_written: bool = False                  # the caller already wrote k/v to the cache (fused kernel)
    # CPU decode: each sequence's K/V also held contiguous (``decode_mirror.py``); ``layer`` (set
    # by the model's forward) picks the layer's part of it
    mirror: MirrorView | None = None
    layer: int = 0


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    kvh, d = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(q, k, v, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
    """q [T, H, d], k/v [T, kvh, d] of the new tokens -> attention output [T, H, d]."""
    if not batch.kv_written:
        write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    if batch.decode:
        if batch.triton_decode:
            from opencomposer.inference.kernels.fused import paged_decode

            return paged_decode(q, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.decode_counters)
        if batch.mirror is not None:
            return _decode_mirrored(q, k, v, batch.mirror, batch.layer)
        if batch.decode_mask is None:
            batch.decode_mask = decode_mask(batch.block_tables, batch.context_lens, k_cache.shape[1], q.dtype)
        return _decode(q, k_cache, v_cache, batch.block_tables, batch.decode_mask)
    if batch.prefill_tables is not None:
        from opencomposer.inference.kernels.prefill import paged_prefill

        return paged_prefill(q, k_cache, v_cache, batch.prefill_tables, batch.prefill_seqs, batch.prefill_tiles,
                             batch.prefill_tile, batch.prefill_splits)
    out = torch.empty_like(q)
    if batch.fresh_index is not None:
        out[batch.fresh_rows] = _prefill_fresh(q, k, v, batch.fresh_index, batch.fresh_valid)
    for s in batch.prefill:
        out[s.q_start:s.q_start + s.q_len] = _prefill_one(q, k, v, k_cache, v_cache, s)
    return out


def attention_backends():
    """Context for every model forward: SDPA without cuDNN. cuDNN plans each new shape on
    the CPU (milliseconds per call) and prefill shapes change every step; the flash and
    memory-efficient kernels need no planning."""
    return sdpa_kernel(_BACKENDS)


def _prefill_fresh(q, k, v, index, valid):
    """Sequences with nothing cached, as one right-padded causal batch. Padding sits after
    each sequence's last token, so under the causal mask no real query ever sees it."""
    h, kvh = q.shape[1], k.shape[1]
    qq = q[index].transpose(1, 2)  # [n, H, L, d]
    kk = k[index].transpose(1, 2).repeat_interleave(h // kvh, dim=1)
    vv = v[index].transpose(1, 2).repeat_interleave(h // kvh, dim=1)
    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    return out.transpose(1, 2)[valid]  # [m, H, d], in flat order


def decode_mask(block_tables, context_lens, block_size: int, dtype) -> torch.Tensor:
    """Additive [B, 1, 1, S] mask over the gathered blocks (shared by all layers)."""
    return length_mask(context_lens, block_tables.shape[1] * block_size, dtype)


def length_mask(lens: torch.Tensor, width: int, dtype) -> torch.Tensor:
    """Additive [B, 1, 1, width] mask: 0 for each row's first ``lens`` keys, -inf after them."""
    keep = torch.arange(width, device=lens.device)[None, :] < lens[:, None]
    zero = torch.zeros((), dtype=dtype, device=lens.device)
    return torch.where(keep, zero, float("-inf")).view(len(lens), 1, 1, width)


def _decode(q, k_cache, v_cache, block_tables, mask):
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    width = block_tables.shape[1] * k_cache.shape[1]
    blocks = block_tables.reshape(-1)  # index_select copies whole blocks: ~4x faster than k_cache[block_tables] on a CPU
    kk = k_cache.index_select(0, blocks).view(b, width, kvh, d).transpose(1, 2)  # [B, kvh, S, d]
    vv = v_cache.index_select(0, blocks).view(b, width, kvh, d).transpose(1, 2)
    qq = q.reshape(b, kvh, h // kvh, d)
    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)
    return out.reshape(b, h, d)


def _decode_mirrored(q, k, v, m, layer: int):
    """Decode attention over the mirror's contiguous K/V (``decode_mirror.MirrorView``): write
    the new tokens' K/V there, then one SDPA over its slots (rows in slot order, then back)."""
    b, h, d = q.shape
    kvh = k.shape[1]
    mk, mv = m.k[layer], m.v[layer]  # [slots, kvh, cap, d]
    mk[m.slot, :, m.pos] = k.to(mk.dtype)
    mv[m.slot, :, m.pos] = v.to(mv.dtype)
    qq = q.reshape(b, kvh, h // kvh, d)
    if m.order is not None:
        qq = qq.index_select(0, m.order)
    out = F.scaled_dot_product_attention(qq, mk[:b, :, :m.width], mv[:b, :, :m.width], attn_mask=m.mask)
    if m.order is not None:
        out = out.index_select(0, m.slot)
    return out.reshape(b, h, d)


def _prefill_one(q, k, v, k_cache, v_cache, s: PrefillSeq) -> torch.Tensor:
    h, d = q.shape[1], q.shape[2]
    kvh = k.shape[1]
    rows = slice(s.q_start, s.q_start + s.q_len)
    qi = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
    if s.ctx_len == s.q_len:  # nothing cached: attend to the fresh K/V directly
        ki, vi = k[rows], v[rows]
        mask, causal = None, True
    else:
        ki = k_cache.index_select(0, s.block_table).view(-1, kvh, d)[: s.ctx_len]
        vi = v_cache.index_select(0, s.block_table).view(-1, kvh, d)[: s.ctx_len]
        offset = s.ctx_len - s.q_len
        qpos = torch.arange(s.q_len, device=q.device)[:, None] + offset
        mask = torch.arange(s.ctx_len, device=q.device)[None, :] <= qpos
        causal = False
    rep = h // kvh
    ki = ki.transpose(0, 1).repeat_interleave(rep, dim=0).unsqueeze(0).to(q.dtype)
    vi = vi.transpose(0, 1).repeat_interleave(rep, dim=0).unsqueeze(0).to(q.dtype)
    out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=causal)
    return out[0].transpose(0, 1)  # [n, H, d]
