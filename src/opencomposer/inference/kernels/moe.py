"""A MoE layer for a few tokens (decode) in three Triton kernels and a sum.

With a handful of tokens a sparse layer reads the k experts each token picked and does
almost no arithmetic; what costs is the number of kernels. The general path (``moe.py``:
sort the (token, expert) pairs by expert, two grouped GEMMs, scatter back) runs ~45 small
kernels a layer (sorts, gathers, scatters): ~75 us of a ~165 us layer for one token of
Qwen3-30B-A3B's shape on an H100, against ~49 us for its two grouped GEMMs
(``benchmarks/profile_moe.py``). Here:

* ``moe_route``: per token, softmax over the router logits (fp32), top-k by repeated argmax,
  renormalisation when the model asks for it, and the expert ids written to the route
  buffer at the token's KV slot -- one kernel (the router's logits come from one GEMM);
* ``moe_experts``: per (token, expert) pair and few rows of the expert's weights,
  ``silu(x W_gate^T) * (x W_up^T)``, then ``weight * (h W_down^T)`` -- two GEMV-like kernels
  streaming long weight rows (as ``triton_gemv`` does) -- and the sum over each token's k
  experts (one reduction, fixed order: deterministic). No sort, no scatter. A pair re-reads
  an expert another pair also picked (at 8 tokens x 8 of 128 experts, ~64 reads for ~51
  experts), which is why larger batches take the grouped GEMMs.

Intermediates are rounded to the model dtype where the unfused ops round (each projection's
output, the activation, the weighted expert output), so results match ``moe.Experts`` up to
the order of fp32 sums. ``SparseMoE`` takes this path on CUDA (Triton kernels on) for steps of
at most ``FUSED_MAX_TOKENS`` tokens: against the grouped GEMMs, Qwen3-30B-A3B's shape decoded
1.69 / 1.52 / 1.41 / 1.22 / 0.98 / 0.62x as fast at 1 / 4 / 8 / 16 / 32 / 64 tokens on an H100
(``bench_moe.py --variants engine,engine_grouped`` with the limit raised to 64).

Test: ``pytest tests/unit/inference/test_triton_cpu.py`` (Triton's interpreter, CPU);
``tests/gpu/test_moe_cuda.py`` on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opencomposer.inference.kernels.fused import launch

FUSED_MAX_TOKENS = 16
BLOCK_ROWS = 4  # weight rows a program streams


@triton.jit
def _route_kernel(logits_ptr, idx_ptr, w_ptr, routes_ptr, slots_ptr, E, stride_l,
                  TOPK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, NORM: tl.constexpr,
                  HAS_ROUTES: tl.constexpr):
    t = tl.program_id(0)
    es = tl.arange(0, BLOCK_E)
    e_ok = es < E
    z = tl.load(logits_ptr + t * stride_l + es, mask=e_ok, other=-float("inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z, axis=0))
    p = tl.where(e_ok, p, 0.0)
    p = p / tl.sum(p, axis=0)
    ks = tl.arange(0, BLOCK_K)
    sel = tl.zeros([BLOCK_K], dtype=tl.int32)
    val = tl.zeros([BLOCK_K], dtype=tl.float32)
    q = tl.where(e_ok, p, -1.0)
    for j in tl.static_range(TOPK):
        best = tl.max(q, axis=0)
        at = tl.min(tl.where(q == best, es, BLOCK_E), axis=0)  # the lowest index among equal scores
        sel = tl.where(ks == j, at, sel)
        val = tl.where(ks == j, best, val)
        q = tl.where(es == at, -2.0, q)
    k_ok = ks < TOPK
    if NORM:
        val = val / tl.sum(tl.where(k_ok, val, 0.0), axis=0)
    tl.store(idx_ptr + t * TOPK + ks, sel, mask=k_ok)
    tl.store(w_ptr + t * TOPK + ks, val.to(w_ptr.dtype.element_ty), mask=k_ok)
    if HAS_ROUTES:
        slot = tl.load(slots_ptr + t)
        tl.store(routes_ptr + slot * TOPK + ks, sel.to(routes_ptr.dtype.element_ty), mask=k_ok)


@triton.jit
def _up_kernel(x_ptr, idx_ptr, w_ptr, h_ptr, H, I, stride_x, stride_we, stride_wn, stride_h,
               TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[pair, n] = silu(x[t] . W_gate[e, n]) * (x[t] . W_up[e, n]) for BLOCK_N features n;
    streams BLOCK_N long rows of each, one tile ahead (as ``triton_gemv``)."""
    pair = tl.program_id(0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < I
    ks = tl.arange(0, BLOCK_K)
    t = pair // TOPK
    e = tl.load(idx_ptr + pair).to(tl.int64)
    gate_rows = w_ptr + e * stride_we + ns[:, None] * stride_wn
    up_rows = gate_rows + I * stride_wn
    ok = n_ok[:, None] & (ks < H)[None, :]
    g_w = tl.load(gate_rows + ks[None, :], mask=ok, other=0.0)
    u_w = tl.load(up_rows + ks[None, :], mask=ok, other=0.0)
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + ks
        nxt = kk + BLOCK_K
        ok_next = n_ok[:, None] & (nxt < H)[None, :]
        g_next = tl.load(gate_rows + nxt[None, :], mask=ok_next, other=0.0)
        u_next = tl.load(up_rows + nxt[None, :], mask=ok_next, other=0.0)
        xv = tl.load(x_ptr + t * stride_x + kk, mask=kk < H, other=0.0).to(tl.float32)
        acc_g += tl.sum(g_w.to(tl.float32) * xv[None, :], axis=1)
        acc_u += tl.sum(u_w.to(tl.float32) * xv[None, :], axis=1)
        g_w, u_w = g_next, u_next
    dtype = h_ptr.dtype.element_ty
    g = acc_g.to(dtype).to(tl.float32)
    u = acc_u.to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(h_ptr + pair * stride_h + ns, (s * u).to(dtype), mask=n_ok)


@triton.jit
def _down_kernel(h_ptr, idx_ptr, gate_ptr, w_ptr, o_ptr, H, I, stride_h, stride_we, stride_wn, stride_o,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """o[pair, n] = weight[pair] * (h[pair] . W_down[e, n]), each product rounded to the model
    dtype as the unfused ops round it; the sum over a token's k pairs is the caller's."""
    pair = tl.program_id(0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < H
    ks = tl.arange(0, BLOCK_K)
    e = tl.load(idx_ptr + pair).to(tl.int64)
    rows = w_ptr + e * stride_we + ns[:, None] * stride_wn
    w = tl.load(rows + ks[None, :], mask=n_ok[:, None] & (ks < I)[None, :], other=0.0)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kk = k0 + ks
        nxt = kk + BLOCK_K
        w_next = tl.load(rows + nxt[None, :], mask=n_ok[:, None] & (nxt < I)[None, :], other=0.0)
        hv = tl.load(h_ptr + pair * stride_h + kk, mask=kk < I, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * hv[None, :], axis=1)
        w = w_next
    dtype = o_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + pair).to(tl.float32)
    tl.store(o_ptr + pair * stride_o + ns, (acc.to(dtype).to(tl.float32) * gate).to(dtype), mask=n_ok)


def moe_route(logits: torch.Tensor, top_k: int, norm: bool, dtype: torch.dtype,
              routes: torch.Tensor | None = None, slots: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids [T, k] int32, weights [T, k] in ``dtype``); with
    ``routes`` ([slots, k], int16) each token's ids are also written at ``slots[t]``."""
    t, e = logits.shape
    idx = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(t, top_k, dtype=dtype, device=logits.device)
    has = routes is not None and slots is not None
    launch(_route_kernel, (t,), logits, idx, weights, routes if has else idx, slots if has else idx, e,
           logits.stride(0), TOPK=top_k, BLOCK_K=triton.next_power_of_2(top_k),
           BLOCK_E=triton.next_power_of_2(e), NORM=norm, HAS_ROUTES=has)
    return idx, weights


def moe_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """x [T, H], idx / weights [T, k] (contiguous), gate_up [E, 2I, H], down [E, H, I] -> [T, H]."""
    t, k = idx.shape
    hidden, inter = x.shape[1], down.shape[2]
    h = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    o = torch.empty(t * k, hidden, dtype=x.dtype, device=x.device)
    # few long rows per program (1,024 columns a load), as the dense GEMV streams its weights
    launch(_up_kernel, (t * k, triton.cdiv(inter, BLOCK_ROWS)), x, idx, gate_up, h, hidden, inter, x.stride(0),
           gate_up.stride(0), gate_up.stride(1), h.stride(0), TOPK=k, BLOCK_N=BLOCK_ROWS,
           BLOCK_K=min(1024, triton.next_power_of_2(hidden)))
    launch(_down_kernel, (t * k, triton.cdiv(hidden, BLOCK_ROWS)), h, idx, weights, down, o, hidden, inter,
           h.stride(0), down.stride(0), down.stride(1), o.stride(0), BLOCK_N=BLOCK_ROWS,
           BLOCK_K=min(1024, triton.next_power_of_2(inter)))
    return o.view(t, k, hidden).sum(dim=1)  # over each token's experts, in fp32, rounded once
