"""Triton kernels for the engine on CUDA; each has a torch equivalent used on CPU.

A decode step of a small model is launch-bound: dozens of tiny kernels per layer. These
fuse the element-wise work around the matrix multiplies:

* ``rope_and_cache``: rotary embedding of q and k in place in the fused qkv output, and
  the write of k and v into their paged-cache slots (torch: ~10 kernels);
* ``add_rmsnorm``: residual add + RMSNorm in one pass (torch: 2 kernels);
* ``silu_mul``: SiLU(gate) * up (torch: 2 kernels);
* ``paged_decode``: decode attention over the block table (torch: gather + SDPA).

They compute in fp32 and round once, where the HF modules round to the model dtype after
each op: in bf16 results may differ by an ulp; in fp32 they agree to rounding.

Paged decode: one program per (sequence, KV head, split of the context): it loads the
query heads that share that KV head (padded to 16 rows for ``tl.dot``), walks its part of
the context 64 tokens (several cache blocks) at a time with an online softmax (running max, running
sum, fp32 accumulator). The split programs of one (sequence, KV head) then count
themselves in on an arrival counter (an atomic add): the last to arrive merges all the
splits' partial states into the output and resets the counter, so no second kernel runs
(at batch 1 that second kernel was one more link in each layer's chain of dependent
kernels). With one split a program writes the output itself. It reads each K/V entry once
and never past the sequence's length -- the torch path gathers the block table's full
padded width and then masks it.

Programmatic dependent launch (PDL, Hopper and newer): inside ``pdl_launches()`` every kernel of
these modules is launched so that it may start while the kernel before it is finishing,
and waits (``gdc_wait``) before it reads anything that kernel wrote; it then lets the next
one start (``gdc_launch_dependents``). A decode step at batch 1 is ~200 small kernels in a
row, each otherwise paying launch, ramp-up and memory latency after the previous one
drained; the GEMVs also start streaming their weights before the wait. Because every
kernel signals only after its own wait, a kernel that starts early may read what kernels
two or more back wrote, never its direct predecessor's output. ``ModelRunner`` turns it
on for CUDA devices of compute capability 9.0+ (``pdl=None``); off, the instructions are
not compiled in.

Checked against the torch paths in ``tests/gpu/test_engine_cuda.py``.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl

_PDL = [False]


@contextlib.contextmanager
def pdl_launches():
    """Inside, this package's Triton kernels launch with programmatic dependent launch (a
    process-wide switch, on for the duration: two engines in one process may differ)."""
    _PDL[0] = True
    try:
        yield
    finally:
        _PDL[0] = False


def pdl_args() -> dict:
    """Keyword arguments of a kernel launch: the ``USE_PDL`` constexpr, and the launch flag
    when on (Triton releases before PDL support do not know ``launch_pdl``)."""
    return {"USE_PDL": True, "launch_pdl": True} if _PDL[0] else {"USE_PDL": False}


_COMPILE_ONLY = [False]


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``; inside ``parallel_compile`` only its compile is queued."""
    if _COMPILE_ONLY[0]:
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def parallel_compile(device: torch.device, threads: int | None = None):
    """Inside, kernel launches through ``launch`` queue their compiles instead of running, and
    ``threads`` compiles (default: one per CPU core, at most 16) run at a time; leaving waits for
    them all. For start-up: run the warm-up code once inside to compile every variant it will
    need in parallel, then again outside to run it (Triton's ``AsyncCompileMode``: its native
    passes and ptxas release the GIL; on an H100 box 16 threads compiled the prefill kernel's
    variants ~4x faster than one). Where that cannot be (no CUDA, Triton's interpreter, a Triton
    before 3.4, already inside) launches just run, so the code inside must be safe to run twice."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        AsyncCompileMode = None
    threads = threads or min(16, os.cpu_count() or 1)
    if (AsyncCompileMode is None or device.type != "cuda" or threads < 2 or _COMPILE_ONLY[0]
            or os.environ.get("TRITON_INTERPRET") == "1"):
        yield
        return
    with ThreadPoolExecutor(threads) as pool, AsyncCompileMode(pool):
        _COMPILE_ONLY[0] = True
        try:
            yield
        finally:
            _COMPILE_ONLY[0] = False


def pdl_supported(device: torch.device) -> bool:
    """Compute capability 9.0+ and a Triton with the grid-dependency instructions (3.4+)."""
    has_gdc = hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait")
    return device.type == "cuda" and has_gdc and torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def gdc_enter(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel launch (PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _kv_offsets(table_ptr, keys, ok, kvh, dims, stride_kn, stride_ks, stride_kh, BLOCK_SIZE: tl.constexpr):
    """Cache offsets [TILE, HEAD_DIM] of ``keys`` (token positions) of one sequence's block table row."""
    block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    return block[:, None] * stride_kn + (keys % BLOCK_SIZE)[:, None] * stride_ks + kvh * stride_kh + dims[None, :]


@triton.jit
def _decode_tile(q, k, v, ok, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """One key tile of the online softmax: (m_i, l_i, acc) after the keys of ``k``/``v`` where ``ok``."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [GROUP_PAD, TILE]
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, part_acc_ptr, part_ml_ptr, count_ptr, out_ptr,
    scale,
    stride_qb, stride_qh,
    stride_kn, stride_ks, stride_kh,
    stride_tb, stride_ob, stride_oh,
    TOKENS_PER_SPLIT,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One (sequence, KV head, split of the context): softmax state of its tokens, read
    ``TILE`` tokens (several cache blocks, gathered through the block table) at a time; the
    split that arrives last merges them all into ``out``.

    Under PDL the split's first tile is loaded before the wait: lengths and block tables are
    the step's inputs and the cached K/V of earlier tokens was written by earlier steps, all
    complete before this kernel may start (see the module doc). Only the newest token's K/V
    and q come from the kernel just before (``rope_and_cache``): they are read after the
    wait. At batch 1 a split is one tile, so the whole context's read overlaps the previous kernel."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < GROUP
    heads = kvh * GROUP + rows
    length = tl.load(lens_ptr + b)
    first = split * TOKENS_PER_SPLIT
    last = tl.minimum(first + TOKENS_PER_SPLIT, length)
    keys0 = first + tl.arange(0, TILE)
    ok0 = keys0 < last
    offs0 = _kv_offsets(tables_ptr + b * stride_tb, keys0, ok0, kvh, dims, stride_kn, stride_ks, stride_kh, BLOCK_SIZE)
    old = ok0 & (keys0 < length - 1)
    k0 = tl.load(k_ptr + offs0, mask=old[:, None], other=0.0)
    v0 = tl.load(v_ptr + offs0, mask=old[:, None], other=0.0)
    gdc_enter(USE_PDL)
    new = ok0 & (keys0 == length - 1)  # the token this step writes: one row of one split's tile
    k0 = tl.where(new[:, None], tl.load(k_ptr + offs0, mask=new[:, None], other=0.0), k0)
    v0 = tl.where(new[:, None], tl.load(v_ptr + offs0, mask=new[:, None], other=0.0), v0)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    if last > first:  # a split past the sequence's end keeps the empty state (the merge skips it)
        m_i, l_i, acc = _decode_tile(q, k0, v0, ok0, m_i, l_i, acc, scale, PRECISION)
    for t0 in range(first + TILE, last, TILE):
        keys = t0 + tl.arange(0, TILE)
        ok = keys < last
        offs = _kv_offsets(tables_ptr + b * stride_tb, keys, ok, kvh, dims, stride_kn, stride_ks, stride_kh, BLOCK_SIZE)
        k = tl.load(k_ptr + offs, mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=ok[:, None], other=0.0)
        m_i, l_i, acc = _decode_tile(q, k, v, ok, m_i, l_i, acc, scale, PRECISION)
    out_rows = out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :]
    if SPLITS == 1:
        tl.store(out_rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        pair = b * tl.num_programs(1) + kvh
        part = pair * SPLITS + split
        tl.store(part_acc_ptr + part * GROUP_PAD * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :], acc)
        tl.store(part_ml_ptr + part * 2 * GROUP_PAD + rows, m_i)
        tl.store(part_ml_ptr + part * 2 * GROUP_PAD + GROUP_PAD + rows, l_i)
        # every thread's stores are issued before the one release below (the CTA barrier), and
        # the acquire makes the other splits' stores visible to the program that arrives last
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            used = tl.minimum(tl.cdiv(length, TOKENS_PER_SPLIT), SPLITS)  # splits holding tokens
            _merge_splits(part_acc_ptr, part_ml_ptr, out_rows, pair * SPLITS, used, rows, dims, row_ok,
                          GROUP_PAD, HEAD_DIM)
            tl.store(count_ptr + pair, 0)  # ready for the next layer and step


@triton.jit
def _merge_splits(part_acc_ptr, part_ml_ptr, out_rows, base, used, rows, dims, row_ok,
                  GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Merge splits ``base`` .. ``base + used - 1``'s (max, sum, acc) into ``out_rows``; loads
    bypass L1 (``.cg``): other programs wrote them."""
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for sp in range(used):
        m_s = tl.load(part_ml_ptr + (base + sp) * 2 * GROUP_PAD + rows, cache_modifier=".cg")
        l_s = tl.load(part_ml_ptr + (base + sp) * 2 * GROUP_PAD + GROUP_PAD + rows, cache_modifier=".cg")
        a = tl.load(part_acc_ptr + (base + sp) * GROUP_PAD * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :],
                    cache_modifier=".cg")
        m_new = tl.maximum(m, m_s)
        old_w = tl.exp(m - m_new)
        new_w = tl.exp(m_s - m_new)
        l_sum = l_sum * old_w + l_s * new_w
        acc = acc * old_w[:, None] + a * new_w[:, None]
        m = m_new
    tl.store(out_rows, (acc / l_sum[:, None]).to(out_rows.dtype.element_ty), mask=row_ok[:, None])


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, counters: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, d] (last dim contiguous); caches [N, block_size, kvh, d] -> out [B, H, d].

    The context is split into up to ``SPLITS`` ranges of blocks processed by separate
    programs (flash-decoding), so a small batch still fills the GPU; the last split of each
    (sequence, KV head) to finish merges them. ``counters``: int32 [>= B * kvh], all zero,
    left zero (the engine keeps one per model runner: its steps run one at a time on one
    stream; two kernels sharing counters must not run at once); None: a new zeroed one.
    Shapes depend only on the block table's width, so CUDA graphs can capture it.
    """
    b, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    group = h // kvh
    group_pad = max(16, triton.next_power_of_2(group))
    tile = 64 if d <= 128 else 32
    # at small batch, split the (padded) context so every split is about one tile and the
    # programs fill the GPU; at large batch the sequences alone do
    tiles = triton.cdiv(block_tables.shape[1] * bs, tile)
    splits = max(1, min(32, tiles, 256 // max(1, b * kvh)))
    per_split = triton.cdiv(tiles, splits) * tile
    if counters is not None and (counters.numel() < b * kvh or counters.dtype != torch.int32):
        raise ValueError(f"paged_decode: counters must be int32 with >= {b * kvh} entries, got "
                         f"{counters.dtype} x {counters.numel()}")
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    part_acc = part_ml = out  # one split writes ``out`` itself: no partial states, no counters
    if splits > 1:
        part_acc = torch.empty((b, kvh, splits, group_pad, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((b, kvh, splits, 2, group_pad), dtype=torch.float32, device=q.device)
        if counters is None:
            counters = torch.zeros(b * kvh, dtype=torch.int32, device=q.device)
    elif counters is None:
        counters = out
    launch(
        _paged_decode_kernel, (b, kvh, splits),
        q, k_cache, v_cache, block_tables, context_lens, part_acc, part_ml, counters, out,
        d ** -0.5,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        per_split,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_SIZE=bs, TILE=tile, SPLITS=splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32: no TF32 rounding
        **pdl_args(),
    )
    return out


@triton.jit
def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, kc_ptr, vc_ptr, stride_t, stride_c, stride_slot,
                       NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                       QK_PAD: tl.constexpr, KV_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)
    t = tl.program_id(0)
    heads = tl.arange(0, QK_PAD)
    ok = heads < NH + NKV
    dims = tl.arange(0, HALF)
    row = qkv_ptr + t * stride_t + heads[:, None] * D + dims[None, :]
    x1 = tl.load(row, mask=ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_c + dims)[None, :]
    s = tl.load(sin_ptr + t * stride_c + dims)[None, :]
    o1 = (x1 * c - x2 * s).to(qkv_ptr.dtype.element_ty)
    o2 = (x2 * c + x1 * s).to(qkv_ptr.dtype.element_ty)
    tl.store(row, o1, mask=ok[:, None])
    tl.store(row + HALF, o2, mask=ok[:, None])
    slot = tl.load(slots_ptr + t).to(tl.int64)
    is_k = ok & (heads >= NH)
    kdst = kc_ptr + slot * stride_slot + (heads - NH)[:, None] * D + dims[None, :]
    tl.store(kdst, o1, mask=is_k[:, None])
    tl.store(kdst + HALF, o2, mask=is_k[:, None])
    vh = tl.arange(0, KV_PAD)
    vd = tl.arange(0, D)
    vok = vh < NKV
    v = tl.load(qkv_ptr + t * stride_t + (NH + NKV + vh)[:, None] * D + vd[None, :], mask=vok[:, None])
    tl.store(vc_ptr + slot * stride_slot + vh[:, None] * D + vd[None, :], v, mask=vok[:, None])


def rope_and_cache(qkv: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor, slots: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, nh: int, nkv: int) -> None:
    """qkv [T, (nh + 2 nkv) * d] (rows contiguous): rotate q and k heads in place, write k, v to
    their slots of the per-layer caches [N, block, nkv, d]. cos/sin_half: [T, d/2] fp32."""
    t = qkv.shape[0]
    d = cos_half.shape[1] * 2
    launch(
        _rope_cache_kernel, (t,),
        qkv, cos_half, sin_half, slots, k_cache, v_cache, qkv.stride(0), cos_half.stride(0), k_cache.stride(1),
        NH=nh, NKV=nkv, D=d, HALF=d // 2, QK_PAD=triton.next_power_of_2(nh + nkv), KV_PAD=triton.next_power_of_2(nkv),
        **pdl_args())


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n, eps, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    gdc_enter(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    if HAS_RESIDUAL:
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
        s = (x + r).to(r_ptr.dtype.element_ty)  # the residual stream stays in the model dtype
        tl.store(r_ptr + row * stride_r + cols, s, mask=m)
    else:
        s = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    sf = s.to(tl.float32)
    y = sf * tl.rsqrt(tl.sum(sf * sf, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=m)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` (in place) and return ``rms_norm(residual) * weight``; 2-D, rows contiguous."""
    out = torch.empty_like(x)
    n = x.shape[1]
    launch(_add_rmsnorm_kernel, (x.shape[0],), x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0),
           n, eps, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=True, **pdl_args())
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``rms_norm(x) * weight`` (fp32 inside) into ``out`` (rows may be strided, e.g. half of a
    wider buffer) or a new tensor; 2-D, each row contiguous."""
    out = torch.empty_like(x) if out is None else out
    n = x.shape[1]
    launch(_add_rmsnorm_kernel, (x.shape[0],), x, x, weight, out, x.stride(0), x.stride(0), out.stride(0), n, eps,
           BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=False, **pdl_args())
    return out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> SiLU(gate_up[:, :I]) * gate_up[:, I:]."""
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    launch(_silu_mul_kernel, (t, triton.cdiv(inter, block)), gate_up, out, gate_up.stride(0), out.stride(0), inter,
           BLOCK=block, **pdl_args())
    return out
