"""Linear layers for a short prefill step (GEMM at M of a few hundred rows), split over K.

An agent turn on a cached history prefills ~200 new tokens. At that M a projection reads
its whole weight once and does little arithmetic per byte, but cuBLAS covers the output
with few tiles (the Qwen2.5-1.5B's down projection: 224 x 1,536 outputs, 24 tiles of 128 x
128 on 132 SMs) and each tile walks all of K alone. Here the K range is also split across
``SPLIT_K`` programs, each writing an fp32 partial sum; a second kernel adds the partials
(in a fixed order: results do not depend on timing) and the bias, and rounds to the model
dtype. With ``SPLIT_K = 1`` the first kernel writes the output itself.

``gemm(x, w, bias, config)`` with ``config = (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps,
stages)``; ``candidates`` lists what ``ModelRunner`` times against cuBLAS.

Test: ``pytest tests/unit/inference/test_triton_cpu.py`` (interpreter, CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opencomposer.inference.triton_kernels import gdc_enter, pdl_args


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N, K, stride_x, stride_w, stride_y,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = ms < M
    n_ok = ns < N
    ks = tl.arange(0, BLOCK_K)
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K  # K is a multiple of BLOCK_K (checked by gemm)
    lo = pid_k * per
    hi = tl.minimum(K, lo + per)
    x_rows = x_ptr + ms[:, None] * stride_x
    w_cols = w_ptr + ns[None, :] * stride_w  # W [N, K] read as W.T [K, N] tiles
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(lo, hi, BLOCK_K, num_stages=STAGES):
        a = tl.load(x_rows + (k0 + ks)[None, :], mask=m_ok[:, None], other=0.0)
        b = tl.load(w_cols + (k0 + ks)[:, None], mask=n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + ms[:, None] * stride_y + ns[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(part_ptr + (pid_k * M + ms[:, None]) * N + ns[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits(part_ptr, b_ptr, y_ptr, M, N, stride_y, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs // N * stride_y + n, acc.to(y_ptr.dtype.element_ty), mask=ok)


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         config: tuple[int, int, int, int, int, int]) -> torch.Tensor:
    """``x`` [M, K] (rows contiguous), ``weight`` [N, K] -> ``x @ weight.T + bias`` [M, N]."""
    m, k = x.shape
    n, k2 = weight.shape
    bm, bn, bk, split, warps, stages = config
    if k2 != k:
        raise ValueError(f"gemm: x has {k} columns, weight expects {k2}")
    if k % bk:
        raise ValueError(f"gemm: K = {k} is not a multiple of BLOCK_K = {bk}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemm: x and weight need contiguous rows")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = y
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    _gemm_kernel[grid](x, weight, bias if bias is not None else weight, y, part, m, n, k, x.stride(0),
                       weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
                       BLOCK_K=bk, SPLIT_K=split, STAGES=stages, num_warps=warps, **pdl_args())
    if split > 1:
        block = 1024
        _sum_splits[(triton.cdiv(m * n, block),)](part, bias if bias is not None else weight, y, m, n, y.stride(0),
                                                  HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=block,
                                                  num_warps=4, **pdl_args())
    return y


SMEM_BYTES = 200 * 1024  # what the tiles of all pipeline stages may take (an H100 SM has 228 KiB)


def candidates(m: int, n: int, k: int, sms: int = 132) -> list[tuple[int, int, int, int, int, int]]:
    """Configs to time for one projection at M = ``m``: tiles that fit in shared memory, and
    for each the K splits that bring the programs to about one or two waves of ``sms``."""
    found = []
    bms = sorted({min(256, triton.next_power_of_2(m)), min(128, triton.next_power_of_2(m))})
    for bm in bms:
        for bn in (64, 128, 256):
            if bm * bn > 128 * 256:
                continue
            for bk in (64, 128):
                if k % bk:
                    continue
                stage_bytes = (bm + bn) * bk * 2
                stages = min(4, SMEM_BYTES // stage_bytes)
                if stages < 2:
                    continue
                tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                k_tiles = k // bk
                splits = {1}
                for waves in (1, 2):
                    s = max(1, min(k_tiles // 2, round(waves * sms / tiles)))
                    splits.add(s)
                warps = 8 if bm * bn >= 128 * 128 else 4
                found += [(bm, bn, bk, s, warps, stages) for s in sorted(splits)]
    return found
