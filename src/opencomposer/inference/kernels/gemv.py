"""Small-batch linear layers (GEMV) for decode at batch 1, with the element-wise work before
them fused in.

At batch 1 a decode step reads every weight once and does almost no arithmetic, so it is
bound by memory bandwidth and by how many kernels run one after the other. ``gemv``
computes ``y = prologue(x) @ W.T (+ bias)`` for a few rows of ``x`` (M <= ``MAX_ROWS``),
one program per ``BLOCK_N`` output features, each streaming its rows of ``W`` once, with
one of these prologues computed on the fly (each program recomputes what it needs from
the small input, so no extra kernel runs):

* ``norm`` (+ ``residual``): ``s = x + residual`` (rounded to the model dtype, as the
  residual stream is), ``rms_norm(s) * norm_weight`` -- the decoder layer's residual add and
  RMSNorm before the qkv and gate/up projections. ``s`` is written to a new tensor by the
  first program (out of place, so no program reads a half-updated residual).
* ``silu_mul``: ``silu(x[:, :K]) * x[:, K:]`` -- the MLP activation before ``down_proj``.

Each intermediate is rounded to the model dtype where the unfused ops round (the
normalised input, the activation), so results match ``add_rmsnorm`` + ``F.linear`` up to
the order of the fp32 sums. The engine uses this path for CUDA-graph batch 1 when it is
faster than cuBLAS there: ``ModelRunner`` times, per projection, cuBLAS (with the separate
norm / activation kernel) against a few GEMV configs, and keeps a plan of the fastest.

Test: ``pytest tests/unit/inference/test_triton_cpu.py`` (Triton's interpreter, CPU);
``tests/gpu/test_engine_cuda.py`` on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opencomposer.inference.kernels.fused import launch, pdl_args

MAX_ROWS = 4


@triton.jit
def _gemv_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, r_out_ptr,
                 M, N, K, stride_x, stride_r, stride_w, stride_y, eps,
                 PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """PROLOGUE: 0 none, 1 silu(x[:, :K]) * x[:, K:], 2 rms_norm(x (+ r)) * nw."""
    pid = tl.program_id(0)
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    ks = tl.arange(0, BLOCK_K)
    dtype = y_ptr.dtype.element_ty
    w_rows = w_ptr + ns[:, None] * stride_w
    # the weights are no kernel's output: start streaming the first tile before waiting for
    # the previous kernel (programmatic dependent launch), then always one tile ahead
    w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & (ks < K)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if PROLOGUE == 2:
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            ok = m_ok[:, None] & (kk < K)[None, :]
            s = tl.load(x_ptr + ms[:, None] * stride_x + kk[None, :], mask=ok, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(r_ptr + ms[:, None] * stride_r + kk[None, :], mask=ok, other=0.0).to(tl.float32)
                s = (s + r).to(dtype).to(tl.float32)
            sq += tl.sum(s * s, axis=1)
        rstd = tl.rsqrt(sq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        ok = m_ok[:, None] & k_ok[None, :]
        nxt = kk + BLOCK_K
        w_next = tl.load(w_rows + nxt[None, :], mask=n_ok[:, None] & (nxt < K)[None, :], other=0.0)
        if PROLOGUE == 1:
            g = tl.load(x_ptr + ms[:, None] * stride_x + kk[None, :], mask=ok, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + ms[:, None] * stride_x + K + kk[None, :], mask=ok, other=0.0).to(tl.float32)
            a = (g / (1.0 + tl.exp(-g)) * u).to(dtype).to(tl.float32)
        elif PROLOGUE == 2:
            s = tl.load(x_ptr + ms[:, None] * stride_x + kk[None, :], mask=ok, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(r_ptr + ms[:, None] * stride_r + kk[None, :], mask=ok, other=0.0).to(tl.float32)
                s = (s + r).to(dtype)
                tl.store(r_out_ptr + ms[:, None] * stride_x + kk[None, :], s, mask=ok & (pid == 0))
                s = s.to(tl.float32)
            nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            a = (s * rstd[:, None] * nw[None, :]).to(dtype).to(tl.float32)
        else:
            a = tl.load(x_ptr + ms[:, None] * stride_x + kk[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        w = w_next
    if HAS_BIAS:
        acc += tl.load(b_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + ms[:, None] * stride_y + ns[None, :], acc.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


ROLES = ("qkv", "o", "gate_up", "down", "lm_head")  # the projections a decode step runs


def block_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): long rows of W per program (1024 columns a load) and
    few of them, so each program streams contiguous memory; measured on an H100/H200 for
    the Qwen2.5-0.5B/1.5B shapes at M = 1 (see ``candidates`` for what is tried)."""
    block_k = min(1024, triton.next_power_of_2(k))
    block_n = 4 if n <= 4096 else 8 if n <= 65536 else 16
    bm = triton.next_power_of_2(m)
    while bm * block_n * block_k > 16384 and block_k > 64:
        block_k //= 2
    return block_n, block_k, 4


def candidates(m: int, n: int, k: int) -> list[tuple[int, int, int]]:
    """Configs ``ModelRunner`` times for one projection (the heuristic's and its neighbours)."""
    bn, bk, w = block_config(m, n, k)
    found = {(bn, bk, w), (max(4, bn // 2), bk, w), (bn * 2, bk, w), (bn, bk, 8)}
    if m == 1:  # longer loads, more warps: the winners for most Qwen2.5 shapes on an H100
        found.add((bn, min(2048, triton.next_power_of_2(k)), 8))
        # a K tile that divides K, so no tile is half masked (K = 1536 -> 512: the 1.5B's
        # qkv and gate_up streamed 1,024 + 512 columns per row with the default)
        div = k & -k
        if 512 <= div < bk:
            found |= {(bn, div, 4), (2 * bn, div, 4)}
        if n <= 4096:  # few output rows: two per program doubles the programs
            found.add((2, bk, 4))
    return sorted(found)


def default_plan(cfg) -> dict[str, tuple[int, int, int]]:
    """Every projection of a ``DecoderConfig`` model on the GEMV path, heuristic configs."""
    return {role: block_config(1, n, k) for role, (n, k) in cfg.projection_shapes().items()}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None, eps: float = 1e-6,
         silu_mul: bool = False, config: tuple[int, int, int] | None = None):
    """``x`` [M, K] (``[M, 2K]`` with ``silu_mul``), ``weight`` [N, K] -> ``y`` [M, N].

    With ``norm_weight`` returns ``(y, s)``: ``s = x + residual`` (``x`` itself when
    ``residual`` is None), the residual stream after this add. Rows contiguous."""
    m = x.shape[0]
    n, k = weight.shape
    if m > MAX_ROWS:
        raise ValueError(f"gemv handles at most {MAX_ROWS} rows, got {m}")
    if silu_mul and norm_weight is not None:
        raise ValueError("gemv: choose one prologue (silu_mul or norm_weight)")
    if x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"gemv: x has {x.shape[1]} columns, weight expects {k}{' x 2 (silu_mul)' if silu_mul else ''}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    r_out = x
    if norm_weight is not None and residual is not None:
        r_out = torch.empty_like(x)
    if m == 0:  # (e.g. the logits of a prefill chunk that samples nothing): no rows, no launch
        return (y, x) if norm_weight is not None else y
    block_n, block_k, warps = config or block_config(m, n, k)
    prologue = 1 if silu_mul else 2 if norm_weight is not None else 0
    launch(
        _gemv_kernel, (triton.cdiv(n, block_n),),
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else weight,
        weight, bias if bias is not None else weight, y, r_out,
        m, n, k, x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0), y.stride(0), eps,
        PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl_args())
    if norm_weight is not None:
        return y, r_out
    return y
