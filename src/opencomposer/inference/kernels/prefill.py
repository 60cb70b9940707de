"""Paged prefill attention (Triton): the new tokens of several sequences attend causally to
their whole context -- a cached prefix and this step's tokens -- read from the paged KV
cache through each sequence's block table.

The torch path (``attention._prefill_one``) gathers each cached sequence's context into a
dense tensor, repeats K/V for every query head, builds a mask and runs SDPA: about ten
kernels per sequence and layer, launched from Python. Here one kernel covers the step.

Its rows are (token, query head) pairs of one KV head's group (grouped-query attention:
the ``GROUP`` query heads that share a KV head are consecutive rows), so a program's tile
of ``BLOCK_M`` rows covers ``BLOCK_M / GROUP`` tokens of every head of the group and each
K/V tile it loads serves all of them: K/V are read once per group instead of once per
query head (6x less for Qwen2.5-1.5B), with one large ``tl.dot`` per key tile. One program
per (tile, KV head) walks the keys ``BLOCK_N`` at a time with an online softmax (fp32),
stopping at the tile's last token (causal). When there are few programs (a short turn on a
long cached prefix) the keys are also split across ``splits`` programs and a second kernel
merges their softmax states (as flash-decoding does); ``splits_for`` picks the count from
the programs and the context length. The caller has already written this step's K/V into
the cache (the fused ``rope_and_cache`` kernel does), so fresh and cached sequences are the
same case.

``plan`` lays the programs out on the host: ``tiles`` [2, P] (sequence, first row of the
tile in that sequence's (token, head-in-group) rows) and ``seqs`` [3, S] (first token in
the flat batch, new tokens, context length). A graph's launch is fixed, so the engine
captures a bucket's graph up to four times when steps on short and long histories want
different split counts or tiles (``graph_variants``: 4 and 16 splits for a 208-token turn of
Qwen2.5-1.5B on 3,000 and 30,000 keys; 128-row tiles for a group of turns on 30,000).

Test: ``pytest tests/unit/inference/test_triton_cpu.py`` (interpreter, CPU);
``tests/gpu/test_engine_cuda.py`` on a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from opencomposer.inference.kernels.fused import (
    gdc_enter,
    launch,
    parallel_compile,
    pdl_args,
)


# arguments that change from step to step are not specialised on (no recompiles mid-rollout);
# the compile-time variants (BLOCK_M x SPLITS) are compiled by ``warm_up`` at engine start
@triton.jit(do_not_specialize=["stride_tb", "stride_seqs", "stride_tiles"])
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, tables_ptr, seqs_ptr, tiles_ptr,
                          scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_slot, stride_kh, stride_tb,
                          stride_seqs, stride_tiles,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                          PRECISION: tl.constexpr, USE_PDL: tl.constexpr, STAGES: tl.constexpr):
    gdc_enter(USE_PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    if SPLITS > 1:
        split = tl.program_id(2)
    else:  # the key loop's start is then known to be 0 at compile time: 10-20% faster (measured)
        split = 0
    s = tl.load(tiles_ptr + pid)
    m0 = tl.load(tiles_ptr + stride_tiles + pid)
    q_start = tl.load(seqs_ptr + s)
    q_len = tl.load(seqs_ptr + stride_seqs + s)
    if q_len == 0:  # a padding tile of a CUDA graph's launch (the padding "sequence"): no work, no
        return      # partial result (its merging program exits too)
    ctx = tl.load(seqs_ptr + 2 * stride_seqs + s)
    rows = m0 + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = rows < q_len * GROUP
    pos = ctx - q_len + tok  # absolute position of each row's token
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    qk_scale = scale * 1.4426950408889634  # scores in log2 units: exp2 instead of exp
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    end = tl.minimum(ctx, ctx - q_len + (m0 + BLOCK_M - 1) // GROUP + 1)  # keys the tile's last token sees
    chunk = tl.cdiv(tl.cdiv(end, BLOCK_N), SPLITS) * BLOCK_N  # this split's share of the keys
    lo = split * chunk
    hi = tl.minimum(end, lo + chunk)
    # whole key tiles that every row of the tile sees (up to its first token's position) need
    # no mask: only the tiles on the causal diagonal and the range's ragged end do
    seen_by_all = tl.minimum(hi, ctx - q_len + m0 // GROUP + 1)
    mid = lo + tl.maximum(seen_by_all - lo, 0) // BLOCK_N * BLOCK_N
    # tl.range pipelines each loop: the next STAGES-1 key tiles are in flight while one computes
    for n0 in tl.range(lo, mid, BLOCK_N, num_stages=STAGES):
        keys = n0 + tl.arange(0, BLOCK_N)
        block = tl.load(tables_ptr + s * stride_tb + keys // BLOCK_SIZE).to(tl.int64)
        offs = (block * BLOCK_SIZE + keys % BLOCK_SIZE)[:, None] * stride_slot + kvh * stride_kh + dims[None, :]
        k = tl.load(k_ptr + offs)
        v = tl.load(v_ptr + offs)
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    for n0 in tl.range(mid, hi, BLOCK_N, num_stages=STAGES):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        block = tl.load(tables_ptr + s * stride_tb + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offs = (block * BLOCK_SIZE + keys % BLOCK_SIZE)[:, None] * stride_slot + kvh * stride_kh + dims[None, :]
        k = tl.load(k_ptr + offs, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=key_ok[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        sc = tl.where(key_ok[None, :] & (keys[None, :] <= pos[:, None]), sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.where(m_new > float("-inf"), tl.exp2(m_i - m_new), 1.0)
        p = tl.where(m_new[:, None] > float("-inf"), tl.exp2(sc - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLITS == 1:
        tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (pid * tl.num_programs(1) + kvh) * SPLITS + split
        tl.store(part_acc_ptr + part * BLOCK_M * HEAD_DIM + tl.arange(0, BLOCK_M)[:, None] * HEAD_DIM + dims[None, :], acc)
        tl.store(part_ml_ptr + part * 2 * BLOCK_M + tl.arange(0, BLOCK_M), m_i)
        tl.store(part_ml_ptr + part * 2 * BLOCK_M + BLOCK_M + tl.arange(0, BLOCK_M), l_i)


@triton.jit(do_not_specialize=["stride_seqs", "stride_tiles"])
def _paged_prefill_merge(part_acc_ptr, part_ml_ptr, out_ptr, seqs_ptr, tiles_ptr, stride_ot, stride_oh,
                         stride_seqs, stride_tiles, GROUP: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, USE_PDL: tl.constexpr):
    """Merge the key splits of one (tile, KV head): online-softmax states -> output rows."""
    gdc_enter(USE_PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.load(tiles_ptr + pid)
    m0 = tl.load(tiles_ptr + stride_tiles + pid)
    q_start = tl.load(seqs_ptr + s)
    q_len = tl.load(seqs_ptr + stride_seqs + s)
    if q_len == 0:  # a graph's padding tile: its splits wrote nothing
        return
    r = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    base = (pid * tl.num_programs(1) + kvh) * SPLITS
    for sp in range(SPLITS):
        m_s = tl.load(part_ml_ptr + (base + sp) * 2 * BLOCK_M + r)
        l_s = tl.load(part_ml_ptr + (base + sp) * 2 * BLOCK_M + BLOCK_M + r)
        a = tl.load(part_acc_ptr + (base + sp) * BLOCK_M * HEAD_DIM + r[:, None] * HEAD_DIM + dims[None, :])
        m_new = tl.maximum(m, m_s)
        ok = m_new > float("-inf")  # both empty so far: nothing to weigh
        old_w = tl.where(ok, tl.exp2(m - m_new), 0.0)  # the states are in log2 units
        new_w = tl.where(ok, tl.exp2(m_s - m_new), 0.0)
        l_sum = l_sum * old_w + l_s * new_w
        acc = acc * old_w[:, None] + a * new_w[:, None]
        m = m_new
    rows = m0 + r
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=(rows < q_len * GROUP)[:, None])


class Tile(NamedTuple):
    """A program's shape: ``rows`` (token, head) rows, ``block_n`` keys per inner step, ``warps``."""

    rows: int
    block_n: int = 64
    warps: int = 4


ROWS = (16, 32, 64, 128)  # the tile heights (128: long prompts and groups on long histories, head_dim >= 128)
LONG_STEP = 8192  # tokens in a step from which a head_dim >= 128 model takes 128-row tiles
LONG_HISTORY = 16_000  # keys from which a shorter step of at least LONG_ROWS rows takes them too
LONG_ROWS = 4096
WIDE = (Tile(128, 64, 4), Tile(128, 128, 8))  # the two 128-row tiles: long histories, long fresh steps


def takes_wide(head_dim: int, elem_bytes: int) -> bool:
    """Whether a model's steps may take the 128-row tiles: head_dim >= 128 in a 16-bit type (fp32
    tiles that size would not fit shared memory; with head_dim 64 they were at best 4% faster, up to
    16% slower)."""
    return head_dim >= 128 and elem_bytes <= 2


def tile_for(num_tokens: int, group: int, head_dim: int = 0, elem_bytes: int = 2, keys: int = 0) -> Tile:
    """The tile for a step of ``num_tokens`` new tokens on contexts of up to ``keys`` keys:
    smaller tiles for small steps, so they still fill the GPU; 128-row tiles only where the
    model ``takes_wide`` them, us per layer for Qwen2.5-1.5B on an H100 (``profile_engine.py --rows``, best split count each):

    * a step of ``LONG_STEP`` tokens or more, with 128-key tiles and 8 warps: a fresh
      8,192-token prompt 667 -> 643 (655 with the other 128-row tile); 16,384 tokens 2,834 ->
      2,293 in session 10's sweep (``--sweep``); at 4,096 and below 64 rows are as fast or
      faster, and with head_dim 64 at every length.
    * a shorter step of at least ``LONG_ROWS`` (token, head) rows on a history of
      ``LONG_HISTORY`` keys or more (a lockstep group of agent turns on long contexts, a long
      chunk), with 64-key tiles and 4 warps: 8 turns of 208 tokens on 30,000 keys 910 -> 832,
      on 60,000 1,765 -> 1,547; 16 turns on 16,000 964 -> 885; a 1,024-token chunk on 30,000
      549 -> 488 (the other 128-row tile: 879, 1,679, 929, 529). One turn (1,248 rows) loses
      1-16% at every length (4,000-60,000 keys); on 4,000-8,000 keys groups of 4-16 turns lose
      up to 3.4% or tie, and 4 turns on 16,000 tie.
    """
    wide = takes_wide(head_dim, elem_bytes)
    if wide and num_tokens >= LONG_STEP:
        return WIDE[1]
    if wide and keys >= LONG_HISTORY and num_tokens * group >= LONG_ROWS:
        return WIDE[0]
    rows = num_tokens * group
    return Tile(16 if rows <= 16 else 32 if rows <= 32 else 64)


def num_tiles(num_tokens: int, group: int, rows: int | None = None) -> int:
    """Programs per KV head for one sequence of ``num_tokens`` new tokens in tiles of ``rows``
    (by default its short-history tile's, the most it can take)."""
    return -(-num_tokens * group // (rows or tile_for(num_tokens, group).rows))


def plan(q_starts: list[int], q_lens: list[int], ctx_lens: list[int], rows: int,
         group: int) -> tuple[list[list[int]], list[list[int]]]:
    """Host-side layout: (tiles [2, P]: sequence index and first (token, head) row of each
    program, seqs [3, S]: first flat token, new tokens, context length of each sequence)."""
    tiles: list[list[int]] = [[], []]
    for i, n in enumerate(q_lens):
        for m0 in range(0, n * group, rows):
            tiles[0].append(i)
            tiles[1].append(m0)
    return tiles, [list(q_starts), list(q_lens), list(ctx_lens)]


def resident(head_dim: int) -> int:
    """64-row programs one SM holds at once (shared memory of 3 pipelined K/V tiles):
    2 for head_dim 128, 4 for 64."""
    return max(1, 256 // max(head_dim, 1))


SPLIT_COUNTS = (1, 2, 4, 8, 16)


def splits_for(programs: int, keys: int, head_dim: int, sms: int, among: tuple[int, ...] = SPLIT_COUNTS) -> int:
    """Key splits per (tile, KV head) program, for ``programs`` of them over contexts of up to
    ``keys`` keys on ``sms`` multiprocessors, chosen ``among`` some counts (a bucket's CUDA
    graphs). Few programs (a short step on a long cached prefix) leave most of the GPU idle
    while each walks the whole context; more splits add waves of programs and partial
    results to write and merge. The pick minimises a wave model, in units of one key's work:
    ``waves * keys / splits + 800 * splits * programs / slots``, with ``slots = sms *
    resident(head_dim)`` programs running at once (the fewer splits on a tie).

    Fitted on an H100 (``benchmarks/profile_engine.py --sweep``, us per layer, 64-row tiles):
    one turn of 208 tokens (40 programs, Qwen2.5-1.5B) on 1,000-16,000 keys takes 4 splits
    and on 30,000-60,000 takes 16 (161 and 294 us against 188 and 374 with 4); 8 such turns
    (320 programs) take 2 up to ~4,000 keys, then 4; the 0.5B (head_dim 64, twice the
    programs at once) takes 8 from 8,000 keys for one turn (91.7 against 125.4 us at 30,000)
    and 4-8 for eight; fresh prompts take 1-2. Over the 24 measured turn cases and 4 fresh
    prompts its pick is within 7% of the fastest split count (refitted after the unsplit
    kernel became 10-15% faster: a fresh 3,376-token prompt now takes 1, 152.6 against
    164.6 us with 2)."""
    slots = sms * resident(head_dim)

    def cost(s: int) -> float:
        return -(-programs * s // slots) * keys / s + 800 * s * programs / slots

    return min(sorted(among), key=cost)


def graph_variants(tokens: int, below: int, group: int, kv_heads: int, head_dim: int, elem_bytes: int,
                   max_keys: int, sms: int) -> tuple[tuple[Tile, int], ...]:
    """The (tile, split count) pairs the CUDA graphs of a ``tokens`` bucket (above a ``below``
    one) are captured with (a graph's launch is fixed): what the bucket's smallest step, one
    sequence of ``below + 1`` tokens, takes on histories of 4,096, 8,192 and ``LONG_HISTORY``
    keys (where large buckets' 128-row tiles start, ``tile_for``) and on the longest,
    ``max_keys``; and, for buckets of more than 512 tokens (mostly fresh prompts), on
    ``tokens`` keys. A step replays the variant ``pick_variant`` prefers for it. (With fewer
    points, steps between them ran with too few or too many splits, H100, us per layer: 4
    turns of 208 tokens on 8,000 keys took 1 split, 202 against 164 with 4; 8 turns on 30,000
    keys of a 65,536-token engine 16, 907 against 835 with 8.)
    (Reading the split count from device memory in one graph that launches the most cost a
    208-token turn on 3,000 keys 26% more.)"""
    points = {min(4096, max_keys), max_keys} | ({min(tokens, max_keys)} if tokens > 512 else set())
    points |= {k for k in (8192, LONG_HISTORY) if k < max_keys}
    out = set()
    for keys in points:
        tile = tile_for(tokens, group, head_dim, elem_bytes, keys)
        programs = num_tiles(below + 1, group, tile.rows) * kv_heads
        out.add((tile, splits_for(programs, keys, head_dim, sms)))
    return tuple(sorted(out))


def pick_variant(variants: tuple[tuple[Tile, int], ...], tokens: int, q_lens: list[int], group: int, kv_heads: int,
                 head_dim: int, elem_bytes: int, keys: int, sms: int) -> tuple[Tile, int]:
    """The captured (tile, splits) that a step of sequences of ``q_lens`` new tokens on
    contexts of up to ``keys`` keys replays in a ``tokens`` bucket's graphs: the bucket's tile
    for those keys (the first captured tile if none has it), then the split count
    ``splits_for`` prefers for the step's programs among those captured with it."""
    want = tile_for(tokens, group, head_dim, elem_bytes, keys)
    tile = want if any(t == want for t, _ in variants) else variants[0][0]
    among = tuple(k for t, k in variants if t == tile)
    programs = sum(num_tiles(n, group, tile.rows) for n in q_lens) * kv_heads
    return tile, splits_for(programs, keys, head_dim, sms, among)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  seqs: torch.Tensor, tiles: torch.Tensor, tile: Tile, splits: int = 1,
                  num_stages: int = 3) -> torch.Tensor:
    """q [T, H, d] (last dim contiguous); caches [N, block_size, kvh, d]; tables [S, W]
    int64; seqs [3, S] and tiles [2, P] int64 from ``plan`` with ``tile.rows`` (rows
    contiguous, any row stride) -> out [T, H, d]. Rows no tile covers are left unwritten
    (graph padding)."""
    t, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    n_tiles, rows = tiles.shape[1], tile.rows
    part_acc = part_ml = out
    if splits > 1:
        part_acc = torch.empty((n_tiles, kvh, splits, rows, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((n_tiles, kvh, splits, 2, rows), dtype=torch.float32, device=q.device)
    args = (q, k_cache, v_cache, out, part_acc, part_ml, tables, seqs, tiles, d ** -0.5,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(1), k_cache.stride(2),
            tables.stride(0), seqs.stride(0), tiles.stride(0))
    meta = dict(GROUP=h // kvh, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_M=rows, BLOCK_N=tile.block_n, SPLITS=splits,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=tile.warps)
    launch(_paged_prefill_kernel, (n_tiles, kvh, splits), *args, **meta, STAGES=num_stages, **pdl_args())
    if splits > 1:
        launch(_paged_prefill_merge, (n_tiles, kvh), part_acc, part_ml, out, seqs, tiles, out.stride(0), out.stride(1),
               seqs.stride(0), tiles.stride(0), GROUP=h // kvh, HEAD_DIM=d, BLOCK_M=rows, SPLITS=splits, **pdl_args())
    return out


def warm_up(k_cache: torch.Tensor, num_heads: int) -> None:
    """Compile the eager-path variants (each ``tile_for`` tile x each of ``SPLIT_COUNTS``, kernel
    and merge) now, on a step with no work, rather than in the middle of someone's rollout (a
    compile costs ~0.4 s: it showed up as a 20x prefill ratio in a 10-turn rollout). The
    compiles run in parallel (``parallel_compile``): one at a time they took 37 s of a 77 s
    first start of the Qwen2.5-1.5B engine on an H100 box (``benchmarks/RESULTS.md``)."""
    _, _, kvh, d = k_cache.shape
    dev = k_cache.device
    tiles = [Tile(rows) for rows in ROWS if rows < 128] + (list(WIDE) if takes_wide(d, k_cache.element_size()) else [])
    variants = [(tile, splits) for tile in tiles for splits in SPLIT_COUNTS]
    qkv = torch.zeros(max(ROWS), (num_heads + 2 * kvh) * d, dtype=k_cache.dtype, device=dev)
    nothing = torch.zeros(3, 1, dtype=torch.long, device=dev)  # one sequence of no tokens
    tables, programs = torch.zeros(1, 4, dtype=torch.long, device=dev), torch.zeros(2, 1, dtype=torch.long, device=dev)

    def each() -> None:
        for tile, splits in variants:
            q = qkv[:tile.rows].view(tile.rows, num_heads + 2 * kvh, d)[:, :num_heads]
            paged_prefill(q, k_cache, k_cache, tables, nothing, programs, tile, splits)

    with parallel_compile(dev):
        each()
    each()
