"""Fused sampling of plain rows (Triton, CUDA): ``sampler.sample_plain`` in two kernels.

For each row of logits [B, V] with a temperature T and a greedy flag, in one pass over
the logits (read once, in the model dtype):

* the log-sum-exp of ``logits / T`` (online: running max and sum),
* a draw from ``softmax(logits / T)`` by the Gumbel-max trick: ``argmax(logits / T + G)``
  with ``G = -log(-log(U))``, ``U`` from Philox (``tl.rand``) -- the same distribution as
  ``sampler``'s ``argmax(p / E)``, ``E ~ Exp(1)``,
* the greedy ``argmax(logits)``;

each of ``chunks`` programs per row does a slice of the vocabulary, and a second kernel
merges the slices and writes [token id, logprob of it] per row (``logits[tok] / T - lse``).
The torch version of ``sample_plain`` makes ~8 full passes over fp32 copies of the
logits; at batch 256 x 152k vocabulary that is ~1 GB of memory traffic per step.

The random stream: a device-side int64 ``seed`` that the second kernel increments, so a
CUDA graph that captured these kernels draws fresh numbers on every replay.

Test: ``tests/unit/inference/interp_triton_checks.py`` (interpreter, CPU);
``tests/gpu/test_engine_cuda.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opencomposer.inference.kernels.fused import gdc_enter, launch, pdl_args

BLOCK = 1024


@triton.jit
def _sample_partial(logits_ptr, inputs_ptr, seed_ptr, part_ptr, V, stride_l, stride_in, CHUNK,
                    CHUNKS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(inputs_ptr + row)
    seed = tl.load(seed_ptr).to(tl.int32)
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)   # per-lane running max of logits / T
    s = tl.zeros([BLOCK], dtype=tl.float32)                  # per-lane running sum of exp(. - m)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)  # per-lane best Gumbel key
    best_i = tl.zeros([BLOCK], dtype=tl.int32)
    top = tl.full([BLOCK], float("-inf"), dtype=tl.float32)   # per-lane greedy max
    top_i = tl.zeros([BLOCK], dtype=tl.int32)
    for off in range(lo, hi, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        ok = idx < hi
        x = tl.load(logits_ptr + row * stride_l + idx, mask=ok, other=float("-inf")).to(tl.float32)
        sc = x / temp
        m_new = tl.maximum(m, sc)
        s = tl.where(m_new > float("-inf"), s * tl.exp(m - m_new) + tl.exp(sc - m_new), s)
        m = m_new
        u = tl.rand(seed, row * V + idx)
        key = tl.where(ok, sc - tl.log(-tl.log(u)), float("-inf"))
        better = key > best
        best = tl.where(better, key, best)
        best_i = tl.where(better, idx, best_i)
        higher = x > top
        top = tl.where(higher, x, top)
        top_i = tl.where(higher, idx, top_i)
    # reduce the lanes
    mm = tl.max(m, axis=0)
    ss = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - mm), 0.0), axis=0)
    bk = tl.max(best, axis=0)
    bi = tl.min(tl.where(best == bk, best_i, 2147483647), axis=0)
    tk = tl.max(top, axis=0)
    ti = tl.min(tl.where(top == tk, top_i, 2147483647), axis=0)
    base = part_ptr + (row * CHUNKS + c) * 6
    tl.store(base + 0, mm)
    tl.store(base + 1, ss)
    tl.store(base + 2, bk)
    tl.store(base + 3, bi.to(tl.float32))
    tl.store(base + 4, tk)
    tl.store(base + 5, ti.to(tl.float32))


@triton.jit
def _sample_final(part_ptr, logits_ptr, inputs_ptr, seed_ptr, out_ptr, stride_l, stride_in, stride_out,
                  CHUNKS: tl.constexpr, USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)
    row = tl.program_id(0)
    cs = tl.arange(0, CHUNKS)
    base = part_ptr + (row * CHUNKS + cs) * 6
    m = tl.load(base + 0)
    s = tl.load(base + 1)
    mm = tl.max(m, axis=0)
    lse = mm + tl.log(tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - mm), 0.0), axis=0))
    bk = tl.load(base + 2)
    bi = tl.load(base + 3)
    drawn = tl.min(tl.where(bk == tl.max(bk, axis=0), bi, 3.0e38), axis=0)
    tk = tl.load(base + 4)
    ti = tl.load(base + 5)
    greedy_tok = tl.min(tl.where(tk == tl.max(tk, axis=0), ti, 3.0e38), axis=0)
    temp = tl.load(inputs_ptr + row)
    greedy = tl.load(inputs_ptr + stride_in + row) > 0.5
    tok = tl.where(greedy, greedy_tok, drawn).to(tl.int32)
    chosen = tl.load(logits_ptr + row * stride_l + tok).to(tl.float32) / temp - lse
    tl.store(out_ptr + row, tok.to(tl.float64))
    tl.store(out_ptr + stride_out + row, chosen.to(tl.float64))
    if row == 0:  # next call (or graph replay) draws new numbers
        tl.store(seed_ptr, tl.load(seed_ptr) + 1)


def chunks_for(rows: int) -> int:
    """Programs per row: enough in all to fill an H100 (~2 per SM), a power of two <= 64."""
    return max(1, min(64, triton.next_power_of_2(max(1, 264 // max(1, rows)))))


def sample_plain_fused(logits: torch.Tensor, inputs: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] (rows contiguous), ``inputs`` [2, B] fp32 (temperatures, greedy
    flags), ``seed`` [1] int64 on the device (advanced by one) -> [2, B] fp64."""
    b, v = logits.shape
    chunks = chunks_for(b)
    chunk = triton.cdiv(triton.cdiv(v, chunks), BLOCK) * BLOCK
    part = torch.empty((b, chunks, 6), dtype=torch.float32, device=logits.device)
    out = torch.empty((2, b), dtype=torch.float64, device=logits.device)
    launch(_sample_partial, (b, chunks), logits, inputs, seed, part, v, logits.stride(0), inputs.stride(0), chunk,
           CHUNKS=chunks, BLOCK=BLOCK, **pdl_args())
    launch(_sample_final, (b,), part, logits, inputs, seed, out, logits.stride(0), inputs.stride(0), out.stride(0),
           CHUNKS=chunks, **pdl_args())
    return out
