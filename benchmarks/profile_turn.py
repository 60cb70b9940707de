"""Where one agent turn's prefill goes (GPU): host work vs the graph, kernels by class,
the projections' GEMMs at the turn's size against their limits, and engine start-up.

    PYTHONPATH=src python3 benchmarks/profile_turn.py [--shape qwen2.5-1.5b] [--out turn.json]

On a randomly initialised model of the shape in bf16:

* start-up: wall seconds of ``Engine(...)`` for the rollout benchmark's engine (8 sequences,
  prefill graphs), the decode benchmark's (256 sequences) and an agent engine for 32,768-token
  histories (more prefill graphs), with the graphs' counts, capture seconds and memory;
* a turn (and a lockstep group of 8 turns in one step): ``--new`` new tokens on a cached
  prefix of each ``--prefix`` length, repeated: the
  step's wall time split into schedule(), the host work up to the graph replay, the replay's
  GPU time (CUDA events) and the wait after it; plus the last-prompt-alone prefill of the
  rollout benchmark (3,376 tokens) for comparison;
* a kernel table of the turn's prefill graph replay, summed by class (GEMM, attention, other);
* each projection of a layer (qkv with its bias, o, gate_up, down) at M = the turn's bucket,
  run on all layers' weights in turn (as the graph does, so weights come from HBM): cuBLAS
  with the weight as stored ([N, K]) and transposed ([K, N]), microseconds per layer, TFLOP/s
  and the HBM-read limit.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from opencomposer.inference.engine.batch1_plan import graph_ms
from opencomposer.bench.engine import prefill_alone, projection_ms
from opencomposer.bench.toolkit import bandwidth, emit, random_model
from opencomposer.inference.engine.core import Engine, SamplingParams

GEMM_MARKS = ("gemm", "sm90", "cutlass", "nvjet", "cublas", "splitk")


def classify(name: str) -> str:
    low = name.lower()
    if any(m in low for m in GEMM_MARKS):
        return "gemm"
    if "prefill" in low or "attn" in low or "merge" in low:
        return "attention"
    return "other"


def kernel_classes(fn, reps: int = 5) -> dict:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        per[e.name][0] += 1
        per[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    by_class: dict[str, float] = defaultdict(float)
    for name, (_, us) in per.items():
        by_class[classify(name)] += us / reps
    top = sorted(((n[:70], c // reps, round(us / reps, 1)) for n, (c, us) in per.items()), key=lambda r: -r[2])
    return {"by_class_us": {k: round(v, 1) for k, v in by_class.items()}, "top": top[:16]}


class TimedGraph:
    """Stands in for a captured graph: records when the host calls replay() and the GPU time."""

    def __init__(self, graph, log: list):
        self.graph, self.log = graph, log

    def replay(self):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        self.graph.replay()
        b.record()
        self.log.append((t, time.perf_counter(), a, b))


def turn_phases(engine: Engine, prefix: int, new: int, reps: int, vocab: int, concurrent: int = 1) -> dict:
    g = torch.Generator().manual_seed(prefix)
    rand = lambda k: torch.randint(0, vocab, (k,), generator=g).tolist()
    engine.blocks.invalidate()
    histories = [rand(prefix) for _ in range(concurrent)]
    engine.generate(histories, SamplingParams(max_tokens=1))
    runner, sched = engine.runner, engine.scheduler
    log: list = []
    real = dict(runner.prefill_graphs)
    runner.prefill_graphs = {t: {k: TimedGraph(gr, log) for k, gr in v.items()} for t, v in real.items()}
    schedule = sched.schedule
    marks: list = []

    def timed_schedule():
        t = time.perf_counter()
        b = schedule()
        marks.append((t, time.perf_counter()))
        return b

    sched.schedule = timed_schedule
    rows = []
    try:
        for _ in range(reps):
            log.clear()
            marks.clear()
            s0 = engine.stats()["prefill_seconds"]
            engine.generate([h + rand(new) for h in histories], SamplingParams(max_tokens=1))
            step_s = engine.stats()["prefill_seconds"] - s0
            if len(log) != 1:
                raise RuntimeError(f"expected one prefill graph replay, got {len(log)}")
            t_call, t_ret, a, b = log[0]
            b.synchronize()
            (s_start, s_end) = marks[0]
            rows.append({"step_ms": 1e3 * step_s, "schedule_ms": 1e3 * (s_end - s_start),
                         "host_to_replay_ms": 1e3 * (t_call - s_start), "replay_call_ms": 1e3 * (t_ret - t_call),
                         "graph_gpu_ms": a.elapsed_time(b)})
    finally:
        runner.prefill_graphs = real
        sched.schedule = schedule
    return {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}


def projection_gemms(engine: Engine, m: int, bw: float) -> dict:
    """Each projection at ``m`` rows over all layers, us per layer: as the engine runs it
    (``bench.projection_ms``: the module, weight stored [N, K]) and with the weight
    transposed to [K, N]; TFLOP/s and the HBM-read limit."""
    layers = engine.model.model.layers
    stored = projection_ms(engine.model, m)
    x = {k: torch.randn(m, w, device="cuda", dtype=torch.bfloat16)
         for k, w in (("h", engine.model.cfg.hidden_size), ("i", engine.model.cfg.intermediate_size))}
    roles = {"qkv": (lambda l: l.self_attn.qkv_proj, "h"), "o": (lambda l: l.self_attn.o_proj, "h"),
             "gate_up": (lambda l: l.mlp.gate_up_proj, "h"), "down": (lambda l: l.mlp.down_proj, "i")}
    out = {}
    for role, (get, xin) in roles.items():
        wt = [get(l).weight.t().contiguous() for l in layers]
        bs = [get(l).bias for l in layers]
        n, k = wt[0].shape[1], wt[0].shape[0]
        kn = graph_ms(lambda wt=wt, bs=bs, a=x[xin]: [torch.addmm(b, a, w) if b is not None else a @ w
                                                     for w, b in zip(wt, bs)])
        res = {}
        for name, ms in (("linear", stored[role]), ("matmul_kn", kn)):
            us = 1e3 * ms / len(layers)
            res[name] = {"us_per_layer": round(us, 2), "TFLOPs": round(2 * m * n * k / us / 1e6, 1)}
        res["hbm_limit_us"] = round(n * k * 2 / bw * 1e6, 2)
        res["shape_NK"] = [n, k]
        out[role] = res
        del wt
    return out


def startup(engine: Engine, t0: float) -> dict:
    """An engine's start-up: wall seconds since ``t0``, the graphs' capture seconds and memory, counts."""
    st = engine.stats()
    return {"wall_s": round(time.perf_counter() - t0, 2), "graph_capture_s": st["graph_capture_s"],
            "graph_memory_MiB": round(st["graph_memory_bytes"] / 2**20, 1), "decode_graphs": len(st["cuda_graph_batch_sizes"]),
            "prefill_graphs": st["prefill_graphs"], "prefill_buckets": len(st["prefill_graph_tokens"]),
            "kv_GiB": round(engine.runner.kv_bytes / 2**30, 2), "capture_b1_ms": st["capture_b1_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--prefix", default="1200,3000")
    ap.add_argument("--new", type=int, default=208)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the turn engine's context (default: the rollout benchmark's 3,632); e.g. 32768 with "
                         "--prefix 16000,30000 for turns on long histories")
    ap.add_argument("--no-startup", action="store_true")
    ap.add_argument("--startup-only", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bw = bandwidth("cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "bandwidth_GBps": round(bw / 1e9, 1), "shape": a.shape}
    hf = random_model(a.shape, "cuda", torch.bfloat16)
    vocab = hf.config.vocab_size
    if not a.no_startup:
        t = time.perf_counter()
        e = Engine(hf, None, max_num_seqs=256, max_model_len=128 + 128 + 8, device="cuda", dtype=torch.bfloat16)
        res["startup_decode_engine"] = startup(e, t)
        del e
        torch.cuda.empty_cache()
        # an agent engine for long histories: more prefill graphs (a second key-split count per bucket)
        t = time.perf_counter()
        e = Engine(hf, None, max_num_seqs=8, max_model_len=32768, device="cuda", dtype=torch.bfloat16,
                   max_num_batched_tokens=8192)
        res["startup_long_context_engine"] = startup(e, t)
        del e
        torch.cuda.empty_cache()
    t = time.perf_counter()
    engine = Engine(hf, None, max_num_seqs=8, max_model_len=a.max_model_len or 3376 + 128 + 128, device="cuda",
                    dtype=torch.bfloat16, max_num_batched_tokens=8192)
    res["startup_rollout_engine"] = startup(engine, t)
    print("startup", json.dumps(res), flush=True)
    if a.startup_only:
        emit(res, a.out)
        return
    res["turn"] = {p: turn_phases(engine, int(p), a.new, a.reps, vocab) for p in a.prefix.split(",")}
    print("turn", json.dumps(res["turn"]), flush=True)
    # the turn's graph replayed on the last step's inputs: a turn of ``--new`` tokens (replaying
    # it after a step of another bucket would read that step's rows)
    bucket = engine.runner.prefill_bucket(a.new)
    res["bucket"] = bucket
    # (the graph with the fewest key splits: the one a turn on these short histories replays)
    res["turn_graph_kernels"] = kernel_classes(min(engine.runner.prefill_graphs[bucket].items())[1].replay)
    print("kernels", json.dumps(res["turn_graph_kernels"]), flush=True)
    # a lockstep group of 8 turns (bench engine's "x8" rollouts), one prefill step
    res["turn_x8"] = {p: turn_phases(engine, int(p), a.new, a.reps, vocab, concurrent=8) for p in a.prefix.split(",")}
    print("turn_x8", json.dumps(res["turn_x8"]), flush=True)
    # the last prompt alone, as the rollout benchmark prefills it (fresh, one step)
    g = torch.Generator().manual_seed(1)
    alone = prefill_alone(engine, [torch.randint(0, vocab, (3376,), generator=g).tolist()])
    res["last_alone_3376_ms"] = round(1e3 * statistics.median(alone), 3)
    res["gemms"] = {str(m): projection_gemms(engine, m, bw) for m in (bucket, 3376)}
    print("gemms", json.dumps(res["gemms"]), flush=True)
    emit(res, a.out)


if __name__ == "__main__":
    main()
