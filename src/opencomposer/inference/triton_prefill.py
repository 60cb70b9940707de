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
merges their softmax states (as flash-decoding does). The caller has already written this
step's K/V into the cache (the fused ``rope_and_cache`` kernel does), so fresh and cached
sequences are the same case.

``plan`` lays the programs out on the host: ``tiles`` [2, P] (sequence, first row of the
tile in that sequence's (token, head-in-group) rows) and ``seqs`` [3, S] (first token in
the flat batch, new tokens, context length).

Test: ``pytest tests/unit/inference/test_triton_cpu.py`` (interpreter, CPU);
``tests/gpu/test_engine_cuda.py`` on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opencomposer.inference.triton_kernels import gdc_enter, pdl_args


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
    split = tl.program_id(2)
    s = tl.load(tiles_ptr + pid)
    m0 = tl.load(tiles_ptr + stride_tiles + pid)
    q_start = tl.load(seqs_ptr + s)
    q_len = tl.load(seqs_ptr + stride_seqs + s)  # 0 for the padding "sequence" of a CUDA graph: no work
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


ROWS = (16, 32, 64)  # the BLOCK_M variants


def block_m(num_tokens: int, group: int) -> int:
    """(token, head) rows per program: smaller tiles for small steps, so they still fill the
    GPU; 64 beat 128 on every measured shape, long fresh prompts included (see ``splits_for``)."""
    rows = num_tokens * group
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def num_tiles(num_tokens: int, group: int) -> int:
    """Programs per KV head for one sequence of ``num_tokens`` new tokens."""
    return -(-num_tokens * group // block_m(num_tokens, group))


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


def splits_for(tiles: int, kv_heads: int, head_dim: int) -> int:
    """Key splits per (tile, KV head) program: few tiles (a short step on a long cached
    prefix) would leave most of the GPU idle while each program walks the whole context;
    more splits cost partial results written and merged.

    Measured on an H100 (``benchmarks/profile_engine.py --attention-only [--turn-only]``,
    us per layer, 64-row tiles, 3 stages):

    * head_dim 128 (Qwen2.5-1.5B): 208 new tokens on a 3,000-token prefix 28.9 with 4
      splits (36.0 with 2, 33.0 with 8, 67.8 with 1); 8 such turns in one step 128.3 with 2
      (165.4 with 1); 1,000 fresh tokens 31.4 with 2 (32.2 with 1); 3,376 fresh tokens
      165.1 with 2 (175.1 with 1). 128-row tiles were slower in each case.
    * head_dim 64 (Qwen2.5-0.5B, 4 programs fit an SM where 2 of head_dim 128 do): one split
      wins from a few hundred programs -- 8 turns in one step 66.1 with 1 (80.3 with 2),
      1,000 fresh tokens 20.2 (21.6), 3,376 fresh tokens 101.0 (100.4); one turn 22.4 with
      4 (27.5 with 2, 22.6 with 8)."""
    programs = tiles * kv_heads
    one = 1024 if head_dim >= 128 else 192
    return 8 if programs < 24 else 4 if programs < 64 else 2 if programs < one else 1


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  seqs: torch.Tensor, tiles: torch.Tensor, rows: int, splits: int = 1, block_n: int = 64,
                  num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """q [T, H, d] (last dim contiguous); caches [N, block_size, kvh, d]; tables [S, W]
    int64; seqs [3, S] and tiles [2, P] int64 from ``plan`` (rows contiguous, any row
    stride) -> out [T, H, d]. Rows no tile covers are left unwritten (graph padding)."""
    t, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    n_tiles = tiles.shape[1]
    part_acc = part_ml = out
    if splits > 1:
        part_acc = torch.empty((n_tiles, kvh, splits, rows, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((n_tiles, kvh, splits, 2, rows), dtype=torch.float32, device=q.device)
    args = (q, k_cache, v_cache, out, part_acc, part_ml, tables, seqs, tiles, d ** -0.5,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(1), k_cache.stride(2),
            tables.stride(0), seqs.stride(0), tiles.stride(0))
    meta = dict(GROUP=h // kvh, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_M=rows, BLOCK_N=block_n, SPLITS=splits,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps or 4)
    _paged_prefill_kernel[(n_tiles, kvh, splits)](*args, **meta, STAGES=num_stages or 3, **pdl_args())
    if splits > 1:
        _paged_prefill_merge[(n_tiles, kvh)](part_acc, part_ml, out, seqs, tiles, out.stride(0), out.stride(1),
                                             seqs.stride(0), tiles.stride(0), GROUP=h // kvh, HEAD_DIM=d, BLOCK_M=rows,
                                             SPLITS=splits, **pdl_args())
    return out


def warm_up(k_cache: torch.Tensor, num_heads: int) -> None:
    """Compile the eager-path variants (each ``block_m`` size x each ``splits_for`` value)
    now, on a step with no work, rather than in the middle of someone's rollout (a compile
    costs ~0.4 s: it showed up as a 20x prefill ratio in a 10-turn rollout)."""
    _, _, kvh, d = k_cache.shape
    dev = k_cache.device
    for rows in ROWS:
        qkv = torch.zeros(rows, (num_heads + 2 * kvh) * d, dtype=k_cache.dtype, device=dev)
        q = qkv.view(rows, num_heads + 2 * kvh, d)[:, :num_heads]
        nothing = torch.zeros(3, 1, dtype=torch.long, device=dev)  # one sequence of no tokens
        for splits in (1, 2, 4, 8):
            paged_prefill(q, k_cache, k_cache, torch.zeros(1, 4, dtype=torch.long, device=dev), nothing,
                          torch.zeros(2, 1, dtype=torch.long, device=dev), rows, splits)
