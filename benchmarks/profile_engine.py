"""Where a decode step and an agent turn's prefill spend their time (GPU), with and without
programmatic dependent launch (PDL) between the Triton kernels.

    PYTHONPATH=src python3 benchmarks/profile_engine.py [--shape qwen2.5-1.5b] [--out profile.json]

For each setting (pdl off, pdl on), on a randomly initialised model of the shape in bf16:

* batch-1 decode: engine step wall time and the CUDA-graph replay alone (``bench.engine_decode``),
  and a kernel table of one replay from ``torch.profiler`` (name, calls, microseconds);
* a 10-turn agent rollout (``bench.agent_rollout``): per-turn prefill wall time and tokens,
  the ratio to prefilling the last prompt alone, and a kernel table of one replay of the
  256-token prefill graph (the bucket a turn's ~210 new tokens use).

Also checks that both settings produce the same greedy tokens (PDL changes launch order
only). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict

import torch
import triton

from opencomposer.inference.engine.batch1_plan import graph_ms
from opencomposer.bench.engine import agent_rollout, engine_decode, prefill_alone, roofline
from opencomposer.bench.toolkit import bandwidth, emit, random_model
from opencomposer.inference.engine.core import Engine, SamplingParams


def kernel_table(fn, reps: int = 3, top: int = 14) -> dict:
    """Kernels of ``fn()`` (a graph replay) per call: [(name, calls, us)], their sum, and wall us."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / reps
    per = defaultdict(lambda: [0, 0.0])
    spans = []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        name = e.name if len(e.name) < 60 else e.name[:57] + "..."
        per[name][0] += 1
        per[name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        spans.append((e.time_range.start, e.time_range.end))
    rows = sorted(((k, v[0] // reps, round(v[1] / reps, 1)) for k, v in per.items()), key=lambda r: -r[2])
    busy = 0.0  # union of kernel intervals (overlap counted once)
    last = None
    for s, e in sorted(spans):
        if last is None or s > last:
            busy += e - s
            last = e
        elif e > last:
            busy += e - last
            last = e
    return {"wall_us": round(1e6 * wall, 1), "kernels_per_call": sum(r[1] for r in rows),
            "kernel_sum_us": round(sum(r[2] for r in rows), 1), "busy_us": round(busy / reps, 1), "top": rows[:top]}


def sdpa_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, nseq: int, q_len: int, ctx: int) -> dict:
    """The same attention through torch's SDPA backends (flash, cuDNN) as a yardstick: K/V
    contiguous [nseq, heads, ctx, d] with the KV heads repeated per query head (built outside
    the timing), causal from the bottom right (each new token sees the cached prefix)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    h, kvh, d = q.shape[1], kc.shape[2], q.shape[2]
    dense = lambda c: (c.view(nseq, -1, kvh, d)[:, :ctx].transpose(1, 2)
                       .repeat_interleave(h // kvh, dim=1).contiguous())
    qq = q.reshape(nseq, q_len, h, d).transpose(1, 2).contiguous()
    k, v = dense(kc[:-1]), dense(vc[:-1])  # the grid's caches end with one spare block
    mask = causal_lower_right(q_len, ctx)
    out = {}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def fn(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qq, k, v, attn_mask=mask)
        try:
            out[name] = round(1000 * graph_ms(fn, reps=20), 1)
        except RuntimeError as e:  # backend not built in, or shape unsupported
            out[name] = f"{type(e).__name__}: {str(e)[:60]}"
    return out


def _case(shape: str, q_len: int, ctx: int, nseq: int):
    """Random bf16 inputs of ``paged_prefill`` for ``nseq`` sequences of ``q_len`` new tokens on
    ``ctx``-token contexts of a model shape: (q, k cache, v cache, block tables, GQA group)."""
    from opencomposer.bench.toolkit import SHAPES

    c = SHAPES[shape]
    h, kvh = c["num_attention_heads"], c["num_key_value_heads"]
    d, bs = c["hidden_size"] // h, 16
    nblk = -(-ctx // bs)
    kc = torch.randn(nseq * nblk + 1, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(nseq * q_len, h + 2 * kvh, d, device="cuda", dtype=torch.bfloat16)[:, :h]
    table = torch.arange(nseq * nblk, device="cuda").view(nseq, nblk)
    return q, kc, vc, table, h // kvh


def _time_configs(res: dict, q, kc, vc, table, q_len: int, ctx: int, nseq: int, configs, reps: int) -> None:
    """``res["{rows}x{splits} n{key tile} w{warps} s{stages}"]`` = us of ``paged_prefill`` per config."""
    from opencomposer.inference.kernels.prefill import Tile, paged_prefill, plan

    group = q.shape[1] // kc.shape[2]
    for rows, splits, bn, w, st in configs:
        tiles, seqs = plan([i * q_len for i in range(nseq)], [q_len] * nseq, [ctx] * nseq, rows, group)
        tiles, seqs = torch.tensor(tiles, device="cuda"), torch.tensor(seqs, device="cuda")
        fn = functools.partial(paged_prefill, q, kc, vc, table, seqs, tiles, Tile(rows, bn, w), splits,
                               num_stages=st)
        key = f"{rows}x{splits} n{bn} w{w} s{st}"
        try:
            res[key] = round(1000 * graph_ms(fn, reps=reps), 1)
        except (RuntimeError, triton.runtime.errors.OutOfResources) as e:  # e.g. shared memory
            res[key] = type(e).__name__


def attention_grid(shape: str, turn_only: bool = False) -> dict:
    """``paged_prefill`` alone (one layer, CUDA-graph timed, microseconds) for a turn on a
    cached prefix and for fresh prompts: the (rows, splits) the engine picks
    (``tile_for``/``splits_for``) and neighbours, then kernel knobs (key tile, warps, stages);
    and torch's SDPA flash and cuDNN backends on the same shapes (``sdpa_reference``)."""
    from opencomposer.inference.kernels.prefill import splits_for, tile_for

    out = {}
    # (new tokens, context, sequences): one turn, 8 turns in one step (bench engine's x8 group), fresh prompts
    cases = ((208, 3000, 1), (208, 3000, 8)) if turn_only else ((208, 3000, 1), (1000, 1000, 1), (3376, 3376, 1))
    for q_len, ctx, nseq in cases:
        q, kc, vc, table, group = _case(shape, q_len, ctx, nseq)
        kvh, d = kc.shape[2], kc.shape[3]
        tile0 = tile_for(nseq * q_len, group, d, 2, ctx)
        sp0 = splits_for(-(-nseq * q_len * group // tile0.rows) * kvh, ctx, d,
                         torch.cuda.get_device_properties(0).multi_processor_count)
        res = {"picked": f"{tile0.rows}x{sp0} n{tile0.block_n} w{tile0.warps}", **sdpa_reference(q, kc, vc, nseq, q_len, ctx)}
        # (rows, splits, key tile, warps, pipeline stages)
        configs = [(r, sp, 64, 4, st) for r in (32, 64) for sp in (1, 2, 4, 8) for st in (2, 3)]
        configs += [(tile0.rows, sp0, bn, w, 3) for bn in (32, 64, 128) for w in (4, 8)]
        if turn_only:  # wider: 128-row tiles (half the K/V reads), 8 warps, longer key tiles
            configs = [(r, sp, bn, w, st) for r in (64, 128) for w in (4, 8) for sp in ((1, 2) if nseq > 1 else (2, 4, 8))
                       for bn in (64, 128) for st in (2, 3)]
        _time_configs(res, q, kc, vc, table, q_len, ctx, nseq, configs, reps=20)
        out[f"q{q_len}_ctx{ctx}" + (f"_x{nseq}" if nseq > 1 else "")] = res
    return out


def engine_attention(q, kc, vc, table, nseq: int, q_len: int, ctx: int, max_keys: int = 65536):
    """``paged_prefill`` as the engine launches it for ``nseq`` sequences of ``q_len`` new
    tokens on ``ctx``-token contexts: through a prefill graph's launch (its bucket's padding
    tiles, the captured split count the step prefers) where the step
    fits a graph, else eagerly. -> (label, callable)."""
    from opencomposer.inference.engine.prefill_layout import (
        PREFILL_GRAPH_TOKENS,
        bucket_of,
        bucket_variants,
        tiles_in_bucket,
    )
    from opencomposer.inference.kernels.prefill import (
        paged_prefill,
        pick_variant,
        plan,
        splits_for,
        tile_for,
    )

    h, kvh, d = q.shape[1], kc.shape[2], q.shape[2]
    group, sms = h // kvh, torch.cuda.get_device_properties(q.device).multi_processor_count
    tokens = nseq * q_len
    bucket = bucket_of(tokens, nseq)
    dev = q.device
    if bucket is None:
        tile = tile_for(tokens, group, d, 2, ctx)
        tiles, seqs = plan([i * q_len for i in range(nseq)], [q_len] * nseq, [ctx] * nseq, tile.rows, group)
        pick = splits_for(len(tiles[0]) * kvh, ctx, d, sms)
        return f"eager {tile.rows}x{pick}", functools.partial(
            paged_prefill, q, kc, vc, table, torch.tensor(seqs, device=dev), torch.tensor(tiles, device=dev), tile, pick)
    captured = bucket_variants(PREFILL_GRAPH_TOKENS, group, kvh, d, 2, max_keys, sms)[bucket]
    tile, used = pick_variant(captured, bucket, [q_len] * nseq, group, kvh, d, 2, ctx, sms)
    tiles, seqs = plan([i * q_len for i in range(nseq)], [q_len] * nseq, [ctx] * nseq, tile.rows, group)
    in_bucket = tiles_in_bucket(bucket, group, rows=tile.rows)
    n = len(tiles[0])
    tiles = torch.tensor([tiles[0] + [nseq] * (in_bucket - n), tiles[1] + [0] * (in_bucket - n)], device=dev)
    seqs = torch.tensor([row + [0] for row in seqs], device=dev)  # the padding sequence: no tokens
    table = torch.cat((table, table[:1]))
    names = [f"{t.rows}x{k}" for t, k in captured]
    return (f"graph {bucket}: {tile.rows}x{used} of {names}",
            functools.partial(paged_prefill, q, kc, vc, table, seqs, tiles, tile, used))


def attention_sweep(shape: str) -> dict:
    """``paged_prefill`` alone (one layer, CUDA-graph timed, us) over context lengths: turns of
    208 new tokens (1 and 8 sequences) on 1,000-60,000-token histories at 1-16 key splits,
    and fresh prompts of 512-16,384 tokens (and 8 x 2,048) with 64- and 128-row tiles; each
    case also as the engine launches it (``engine_attention``), and torch's SDPA flash and
    cuDNN on the single sequences. The data behind ``triton_prefill.splits_for`` and
    ``tile_for``."""
    from opencomposer.inference.kernels.prefill import splits_for

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [(208, ctx, n) for n in (1, 8) for ctx in (1000, 3000, 8000, 16000, 30000, 60000)]
    cases += [(n, n, 1) for n in (512, 1000, 2048, 3376, 4096, 8192, 16384)] + [(2048, 2048, 8)]
    out = {}
    for q_len, ctx, nseq in cases:
        q, kc, vc, table, group = _case(shape, q_len, ctx, nseq)
        kvh, d = kc.shape[2], kc.shape[3]
        res = {}
        if nseq == 1:
            res.update(sdpa_reference(q, kc, vc, nseq, q_len, ctx))
        label, fn = engine_attention(q, kc, vc, table, nseq, q_len, ctx)
        res["engine"] = label
        res["engine_us"] = round(1000 * graph_ms(fn, reps=10), 1)
        if q_len < ctx:  # a turn: every split count, 64-row tiles
            configs = [(64, sp, 64, 4, 3) for sp in (1, 2, 4, 8, 16)]
        else:  # a fresh prompt: 64- and 128-row tiles, each at the splits the engine would take
            configs = []
            for r, bn, w in ((64, 64, 4), (128, 128, 8)):
                p = -(-q_len * group // r) * nseq * kvh
                configs.append((r, splits_for(p, ctx, d, sms), bn, w, 3))
        _time_configs(res, q, kc, vc, table, q_len, ctx, nseq, configs, reps=10)
        out[f"q{q_len}_ctx{ctx}" + (f"_x{nseq}" if nseq > 1 else "")] = res
        print(shape, list(out)[-1], json.dumps(res), flush=True)
        del kc, vc
        torch.cuda.empty_cache()
    return out


def rows_sweep(shape: str) -> dict:
    """``paged_prefill`` alone (one layer, CUDA-graph timed, us): 64-row tiles against both
    128-row tiles (64-key tiles and 4 warps; 128-key tiles and 8 warps), each at every split
    count, for lockstep groups of 1-16 turns of 208 tokens on 4,000-60,000-token histories, a
    1,024-token chunk on a long history and fresh 8,192/16,384-token prompts; with the best of
    each family and what the engine launches (``engine_attention``). The data behind
    ``triton_prefill.tile_for``'s long-history rule."""
    cases = [(208, ctx, n) for n in (1, 4, 8, 16) for ctx in (4000, 8000, 16000, 30000, 60000)]
    cases += [(1024, 30000, 1), (8192, 8192, 1), (16384, 16384, 1)]
    families = {"64": (64, 64, 4), "128 n64 w4": (128, 64, 4), "128 n128 w8": (128, 128, 8)}
    out = {}
    for q_len, ctx, nseq in cases:
        q, kc, vc, table, _ = _case(shape, q_len, ctx, nseq)
        res = {}
        label, fn = engine_attention(q, kc, vc, table, nseq, q_len, ctx)
        res["engine"], res["engine_us"] = label, round(1000 * graph_ms(fn, reps=10), 1)
        configs = [(r, sp, bn, w, 3) for r, bn, w in families.values() for sp in (1, 2, 4, 8, 16)]
        _time_configs(res, q, kc, vc, table, q_len, ctx, nseq, configs, reps=10)
        for name, (r, bn, w) in families.items():
            timed = [(v, k) for k, v in res.items() if k.startswith(f"{r}x") and f"n{bn} w{w} " in k
                     and isinstance(v, float)]
            res[f"best {name}"] = min(timed) if timed else None
        out[f"q{q_len}_ctx{ctx}" + (f"_x{nseq}" if nseq > 1 else "")] = res
        print(shape, list(out)[-1], {k: v for k, v in res.items() if k.startswith(("engine", "best"))}, flush=True)
        del kc, vc
        torch.cuda.empty_cache()
    return out


def fresh_prefill(engine: Engine, lengths=(300, 600, 1000, 2000, 3376)) -> dict:
    """Wall ms of one fresh prefill step per prompt length (best of 3, prefix cache cleared)."""
    out = {}
    g = torch.Generator().manual_seed(9)
    for n in lengths:
        prompt = torch.randint(0, engine.model.cfg.vocab_size, (n,), generator=g).tolist()
        out[n] = round(1000 * min(prefill_alone(engine, [prompt])), 3)
    return out


def one(shape: str, pdl: bool, bw: float) -> dict:
    hf = random_model(shape, "cuda", torch.bfloat16)
    out: dict = {}
    engine = Engine(hf, None, max_num_seqs=1, max_model_len=128 + 128 + 8, device="cuda", dtype=torch.bfloat16,
                    pdl=pdl)
    d = engine_decode(engine, 1, 128, 128)
    d["roofline_tokens_per_s"] = roofline(engine, 1, d["mean_context"], bw)
    d["fraction_of_roofline"] = d["tokens_per_s"] / d["roofline_tokens_per_s"]
    out["decode_b1"] = {k: round(v, 4) for k, v in d.items()}
    out["capture_b1_ms"] = engine.stats()["capture_b1_ms"]
    out["gemv_plan"], out["gemv_us_per_layer"] = engine.stats()["gemv_plan"], engine.runner.gemv_timings
    out["decode_b1_kernels"] = kernel_table(engine.runner.graphs[1].replay)
    greedy = engine.generate([list(range(1, 40))], SamplingParams(max_tokens=32, temperature=0))[0].token_ids
    del engine
    engine = Engine(hf, None, max_num_seqs=8, max_model_len=3376 + 128 + 128, device="cuda", dtype=torch.bfloat16,
                    max_num_batched_tokens=8192, pdl=pdl)
    turns = []
    step = engine.step

    def timed_step(eng=engine):  # per-step prefill seconds and tokens, from the engine's own counters
        before = eng.stats()
        res = step()
        after = eng.stats()
        if after["prefill_tokens_computed"] > before["prefill_tokens_computed"]:
            turns.append((after["prefill_tokens_computed"] - before["prefill_tokens_computed"],
                          round(1000 * (after["prefill_seconds"] - before["prefill_seconds"]), 3)))
        return res

    out["fresh_prefill_ms"] = fresh_prefill(engine)
    from torch.profiler import ProfilerActivity, profile

    prompt = list(range(5, 1005))
    engine.blocks.invalidate()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate([prompt], SamplingParams(max_tokens=1))
    engine.blocks.invalidate()
    out["fresh_1000_profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)[-2500:]
    engine.step = timed_step
    import cProfile
    import io
    import pstats

    host = cProfile.Profile()  # where the host's time goes in a rollout (inflated by the profiler)
    host.enable()
    r = agent_rollout(engine)
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(22)
    out["rollout_host_profile"] = text.getvalue()[-4500:]
    engine.step = step
    out["rollout"] = {k: round(v, 4) for k, v in r.items()}
    out["rollout_prefill_steps"] = turns  # (tokens, ms) per prefill step, warm-up and the last-alone runs included
    if 256 in engine.runner.prefill_graphs:  # (the graph with the fewest key splits)
        out["prefill_256_kernels"] = kernel_table(min(engine.runner.prefill_graphs[256].items())[1].replay)
    del engine, hf
    torch.cuda.empty_cache()
    out["greedy"] = greedy
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--out", default=None)
    ap.add_argument("--pdl", default="off,on", help="settings to run: off,on")
    ap.add_argument("--attention-only", action="store_true", help="only the paged-prefill kernel grid")
    ap.add_argument("--no-attention", action="store_true", help="skip the paged-prefill kernel grid")
    ap.add_argument("--turn-only", action="store_true", help="attention grid: only the agent-turn case, more knobs")
    ap.add_argument("--sweep", action="store_true", help="only the paged-prefill kernel over context lengths "
                    "(turns on 1k-60k histories x key splits; fresh 512-16k prompts x tiles)")
    ap.add_argument("--rows", action="store_true", help="only the paged-prefill kernel's 64- against 128-row "
                    "tiles for groups of turns on 4k-60k histories")
    a = ap.parse_args()
    bw = bandwidth("cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "bandwidth_GBps": round(bw / 1e9, 1), "shape": a.shape}
    if a.sweep:
        res["attention_sweep_us"] = attention_sweep(a.shape)
    if a.rows:
        res["attention_rows_us"] = rows_sweep(a.shape)
    if a.sweep or a.rows:
        emit(res, a.out)
        return
    if not a.no_attention:
        res["attention_us"] = attention_grid(a.shape, a.turn_only)
        print("attention", json.dumps(res["attention_us"]), flush=True)
    if a.attention_only:
        print(json.dumps(res))
        return
    for pdl in [v == "on" for v in a.pdl.split(",")]:
        key = "pdl_on" if pdl else "pdl_off"
        res[key] = one(a.shape, pdl, bw)
        print(f"{key}: {json.dumps(res[key])[:4000]}", flush=True)
    if "pdl_on" in res and "pdl_off" in res:
        res["same_greedy_tokens"] = res["pdl_on"].pop("greedy") == res["pdl_off"].pop("greedy")
    emit(res, a.out)


if __name__ == "__main__":
    main()
