"""Which kernel runs each projection of a batch-1 decode step (CUDA, Triton path).

At batch 1 a decode step reads every weight once and does almost no arithmetic, so a
projection can run as cuBLAS (after a separate norm / activation kernel) or as
``triton_gemv`` (norm or activation fused in, in one of a few tile configs). The plan --
``{role: GEMV config, or None for cuBLAS}`` for the roles of ``triton_gemv.ROLES`` -- is
chosen at engine start-up, in two stages:

1. ``tune_projections``: each projection alone, every candidate config and cuBLAS, each
   timed in a CUDA graph that runs it once per layer on that layer's weights, as a decode
   step does (so the weights come from HBM, not L2);
2. ``capture_batch1``: whole decode graphs -- all-cuBLAS, the tuned plan, then that plan
   with each GEMV role moved to cuBLAS in turn (kept when the graph replays faster) --
   and the fastest graph is kept. Alone, the Qwen2.5-1.5B's gate_up timed the same either
   way (24.4 vs 24.6 us per layer on an H100); in the whole graph cuBLAS there replayed
   1.64 ms against 1.79-1.81, so the last word is the whole graph's.

``ModelRunner.capture_ms`` keeps every whole-graph time, ``gemv_timings`` the per-projection
ones (microseconds per layer). ``gemv=True`` skips the timing: heuristic configs everywhere.

Test: ``tests/gpu/test_engine_cuda.py::test_gemv_batch1_graph_matches_cublas_graph``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from opencomposer.inference.engine.cuda_graph import capture

if TYPE_CHECKING:
    from opencomposer.inference.engine.model_runner import ModelRunner


def capture_batch1(runner: ModelRunner) -> torch.cuda.CUDAGraph:
    """The batch-1 decode graph with the plan chosen as above; sets the model's plan,
    ``runner.capture_ms`` and ``runner.gemv`` (whether any projection uses the GEMV)."""
    from opencomposer.inference.kernels.gemv import ROLES, default_plan

    model = runner.model

    def capture(plan):
        model.gemv_rows, model.gemv_plan = (1, plan) if plan else (0, None)
        g = runner._capture_one(1)
        return g, replay_ms(g, reps=30)

    if runner.gemv:
        model.gemv_rows, model.gemv_plan = 1, default_plan(model.cfg)
        return runner._capture_one(1)
    plan = tune_projections(runner)
    g_cublas, t_cublas = capture(None)
    times = {"cublas": t_cublas}
    best = (g_cublas, t_cublas, None)
    if any(plan.values()):
        g, t = capture(plan)
        times["gemv"] = t
        current = (g, t, plan)
        for role in ROLES:
            if not current[2].get(role):
                continue
            trial = {**current[2], role: None}
            if not any(trial.values()):
                continue
            g, t = capture(trial)
            times[f"gemv, {role} on cublas"] = t
            if t < current[1]:
                current = (g, t, trial)
        if current[1] < best[1]:
            best = current
    model.gemv_rows, model.gemv_plan = (1, best[2]) if best[2] else (0, None)
    runner.capture_ms = {k: round(v, 4) for k, v in times.items()}
    runner.gemv = best[2] is not None
    return best[0]


def recapture_few_rows(runner: ModelRunner) -> None:
    """Decode graphs of 2..``triton_gemv.MAX_ROWS`` rows captured again with the batch-1 plan's
    GEMVs (after ``capture_batch1`` chose one), each kept where it replays faster than its
    cuBLAS graph: a few rows still read every weight once. Such graphs serve small decode
    batches and speculative decoding's verify steps (``spec_graph.py``: k + 1 rows a sequence)."""
    from opencomposer.inference.kernels.gemv import MAX_ROWS

    model = runner.model
    if not model.gemv_plan:
        return
    rows = 1
    for b in sorted(b for b in runner.graphs if 1 < b <= MAX_ROWS):
        t_blas = replay_ms(runner.graphs[b], reps=30)
        model.gemv_rows = b
        g = runner._capture_one(b)
        t = replay_ms(g, reps=30)
        runner.capture_ms.update({f"b{b} cublas": round(t_blas, 4), f"b{b} gemv": round(t, 4)})
        if t < t_blas:
            runner.graphs[b], rows = g, b
    model.gemv_rows = rows  # eager forwards of up to this many rows take the GEMVs too


def tune_projections(runner: ModelRunner) -> dict:
    """Per projection: cuBLAS against ``triton_gemv`` in its candidate configs ->
    {role: fastest GEMV config, or None for cuBLAS}; times in ``runner.gemv_timings``."""
    from opencomposer.inference.kernels.gemv import candidates, gemv
    from opencomposer.inference.kernels.fused import (
        add_rmsnorm,
        parallel_compile,
        silu_mul,
    )

    m = runner.model
    layers = list(m.model.layers)
    cfg, dev, dt = m.cfg, runner.device, runner.dtype
    x, r = torch.randn(1, cfg.hidden_size, device=dev, dtype=dt), torch.randn(1, cfg.hidden_size, device=dev, dtype=dt)
    a = torch.randn(1, cfg.num_heads * cfg.head_dim, device=dev, dtype=dt)
    gu = torch.randn(1, 2 * cfg.intermediate_size, device=dev, dtype=dt)

    def qkv(li, c):
        ln, proj = li.input_layernorm, li.self_attn.qkv_proj
        if c is None:
            return proj(add_rmsnorm(x, r, ln.weight, ln.eps))
        return gemv(x, proj.weight, proj.bias, norm_weight=ln.weight, residual=r, eps=ln.eps, config=c)

    def gate_up(li, c):
        ln, proj = li.post_attention_layernorm, li.mlp.gate_up_proj
        if c is None:
            return proj(add_rmsnorm(x, r, ln.weight, ln.eps))
        return gemv(x, proj.weight, norm_weight=ln.weight, residual=r, eps=ln.eps, config=c)

    ops = {
        "qkv": (qkv, layers),
        "o": (lambda li, c: li.self_attn.o_proj(a) if c is None else gemv(a, li.self_attn.o_proj.weight, config=c),
              layers),
        "gate_up": (gate_up, layers),
        "down": (lambda li, c: li.mlp.down_proj(silu_mul(gu)) if c is None else
                 gemv(gu, li.mlp.down_proj.weight, silu_mul=True, config=c), layers),
        "lm_head": (lambda li, c: m.lm_head(x) if c is None else gemv(x, m.lm_head.weight, config=c), [None]),
    }
    with parallel_compile(dev):  # every candidate's kernel compiled at once, nothing run
        for role, (n, k) in cfg.projection_shapes().items():
            for c in candidates(1, n, k):
                ops[role][0](ops[role][1][0], c)
    plan: dict = {}
    for role, (n, k) in cfg.projection_shapes().items():
        op, over = ops[role]
        times = {}
        for c in [None, *candidates(1, n, k)]:
            times["cublas" if c is None else ",".join(map(str, c))] = graph_ms(
                lambda c=c, op=op, over=over: [op(li, c) for li in over], calls=2) / len(over)
        best = min(times, key=times.get)
        plan[role] = None if best == "cublas" else tuple(int(v) for v in best.split(","))
        runner.gemv_timings[role] = {k2: round(1000 * v, 2) for k2, v in times.items()}  # microseconds
    return plan


def replay_ms(g: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    """Milliseconds per replay of ``g`` (after 3 untimed ones)."""
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def graph_ms(fn, calls: int = 1, reps: int = 5) -> float:
    """Milliseconds per call of ``fn``, replayed from a CUDA graph of ``calls`` calls
    (two eager calls first: compilation, allocations and kernel choice stay outside)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with capture(g):
        for _ in range(calls):
            fn()
    return replay_ms(g, reps=reps) / calls
