"""``opencomposer bench engine``: engine throughput against HF ``generate`` and the roofline.

    opencomposer bench engine --shapes qwen2.5-0.5b,qwen2.5-1.5b --device cuda --dtype bfloat16
    PYTHONPATH=src python -m opencomposer.bench.engine --shapes tiny --device cpu   # quick check
    # an RL rollout's decode: its batch, its contexts, seeded requests, an agent engine's table width
    opencomposer bench engine --shapes smollm2-135m --batches 88 --context 128,3000,6000 --seeded \
        --decode-only --max-model-len 8192 --phase-steps 16 [--busy-threads 1 [--switch-ms 0.5]]

For each shape (a randomly initialised Qwen2 of the given size; configs in ``toolkit.SHAPES``):

* decode tokens/s at batch 1, 64 and 256 (prompts of ``prompt_len`` random tokens, timed
  over ``decode_steps`` engine steps after prefill), and the same for HF ``generate``
  at batch 1 and 64 (its decode time: a long run minus a 1-token run); with ``contexts``
  (``--context``) at each of those prompt lengths too (``decode_b{b}_ctx{c}``), with
  ``seeded`` (``--seeded``) for requests that carry a seed as RL rollouts' do, and with
  ``phase_steps`` the step split into host and device time (``step_phases``), and with
  ``busy_threads`` beside pure-Python threads as an RL actor's episodes (``python_load``);
* the memory-bandwidth roofline of each decode step: (weight bytes + K/V bytes read) /
  HBM bandwidth, the bandwidth measured in the same run by a large device-to-device copy;
* prefill tokens/s (engine, and HF's forward on the same batch);
* prefix caching: a 10-turn agent rollout (system prompt, then per turn a model reply and a
  tool result appended) -- total prefill work over the 10 turns against prefilling the
  last turn's prompt alone (tokens and seconds, medians of 3 runs each; goal <= 1.2x); and
  the same for ``prefill_batch`` rollouts in lockstep (an RL actor's group on one engine:
  each turn's prompts prefilled in one step) against their last prompts prefilled together;
* logprob parity (first shape): the engine's logprobs of its sampled tokens against the HF
  forward pass on the same weights, in fp32 and in the benchmark dtype;
* per shape, the decode engine's start-up (``startup``: seconds, by part, the graphs' memory
  and counts; the first engine in a process on a fresh machine includes Triton's compiles);
* per shape, the batch-1 projection plan the engine chose at start-up (``gemv_plan``:
  a Triton GEMV config or cuBLAS per projection) and the candidate graphs' replay times
  (``capture_b1_ms``: all-cuBLAS, the per-projection plan, and the plan with each
  GEMV role moved to cuBLAS in turn; the fastest graph is kept).

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import contextlib
import json
import platform
import time
from typing import Any

import torch
import torch.nn.functional as F

from opencomposer.bench.toolkit import _figures, _prompts, _r4, _sync, bandwidth, emit, random_model, time_ms
from opencomposer.inference.engine.core import Engine, SamplingParams


def engine_decode(engine: Engine, batch: int, prompt_len: int, steps: int, seed: int = 0,
                  windows: int = 4, seeded: bool = False, phase_steps: int = 0) -> dict[str, float]:
    """Decode tokens/s of ``batch`` sequences of ``prompt_len`` prompt tokens each over
    ``steps`` steps, timed in ``windows`` equal windows: the median window's rate, with the
    slowest and fastest (at batch 256 on the 0.5B shape a step is host-bound, and one run's
    rate moved by 40% between runs that timed all steps as one window).

    ``seeded``: every request has its own ``seed``, as an RL rollout's do
    (``policies/engine.py``): such rows are sampled outside the decode graph and the engine
    does not run ahead. ``phase_steps`` > 0: then that many more steps, each split into its
    parts (``step_phases``: host vs device time), reported as ``phase_*_ms``."""
    import statistics

    vocab = engine.model.cfg.vocab_size
    warm = 3
    params = [SamplingParams(max_tokens=steps + warm + phase_steps + 1, temperature=1.0,
                             seed=1000 + i if seeded else None) for i in range(batch)]
    rids = [engine.add_request(p, sp) for p, sp in zip(_prompts(batch, prompt_len, vocab, seed), params)]
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(warm):
        engine.step()
    per = max(1, steps // windows)
    times = []
    generated = engine.stats()["generated_tokens"]
    for _ in range(steps // per):
        _sync(str(engine.device))
        t = time.perf_counter()
        for _ in range(per):
            engine.step()
        _sync(str(engine.device))
        times.append(time.perf_counter() - t)
    dt = statistics.median(times)
    out = {"tokens_per_s": batch * per / dt, "tokens_per_s_min": batch * per / max(times),
           "tokens_per_s_max": batch * per / min(times), "step_ms": 1000 * dt / per,
           "context": prompt_len, "mean_context": prompt_len + warm + per * len(times) / 2,
           # tokens the engine reported while timed (a step left in flight is read by the next one)
           "tokens_timed": engine.stats()["generated_tokens"] - generated, "steps_timed": per * len(times)}
    if phase_steps:
        out.update({f"phase_{k}_ms": v for k, v in step_phases(engine, phase_steps).items()})
    graph = engine.runner.graphs.get(engine.runner.decode_bucket(batch) or 0)
    if graph is not None:  # the GPU part of a step alone (replays the last step: same slots, same values)
        _sync(str(engine.device))
        t = time.perf_counter()
        for _ in range(20):
            graph.replay()
        _sync(str(engine.device))
        out["graph_replay_ms"] = 1000 * (time.perf_counter() - t) / 20
    for r in rids:
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    for r in rids:
        engine.completion(r)
    return out


@contextlib.contextmanager
def python_load(threads: int, switch_ms: float | None = None):
    """Inside: ``threads`` threads running pure-Python work, as an RL actor's episode threads
    (prompt rendering, reply parsing, tool bookkeeping) run beside the engine's stepping thread
    in one process; and the interpreter's switch interval at ``switch_ms`` (None: as it is).
    Each time a step waits for the device (or copies from pageable memory) it lets go of the
    GIL; a busy thread takes it, and the step gets it back only when that thread is made to
    let go, after up to a switch interval (5 ms by default)."""
    import sys
    import threading

    old = sys.getswitchinterval()
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            json.loads(json.dumps({"turn": list(range(64)), "text": "x" * 256}))

    pool = [threading.Thread(target=work, daemon=True) for _ in range(threads)]
    if switch_ms is not None:
        sys.setswitchinterval(switch_ms / 1000)
    try:
        for t in pool:
            t.start()
        yield
    finally:
        stop.set()
        for t in pool:
            t.join()
        sys.setswitchinterval(old)


def step_phases(engine: Engine, steps: int) -> dict[str, float]:
    """Mean milliseconds per engine step of its parts, over ``steps`` steps: ``schedule``
    (host), ``run_host`` (building the step's inputs and launching it: ``ModelRunner.run``,
    or ``launch_next`` when it runs ahead, up to their return), ``run_device`` (the wait for
    the device after that: forward, and sampling in the graph), ``sample`` (sampling outside
    the graph, its device->host copy included), ``other`` (the rest: reading results, stop
    checks, bookkeeping) and ``step``. The device is synchronised after each timed part, so
    run-ahead overlaps nothing here: the sum is a step run serially, not the timed rate."""
    from opencomposer.inference.engine import core

    dev = str(engine.device)
    acc = dict.fromkeys(("schedule", "run_host", "run_device", "sample"), 0.0)

    def timed(fn, host: str, device: str | None = None):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            t1 = time.perf_counter()
            _sync(dev)
            acc[host] += t1 - t0 if device else time.perf_counter() - t0
            if device:
                acc[device] += time.perf_counter() - t1
            return out
        return wrapper

    sch, runner = engine.scheduler, engine.runner
    patched = [(sch, "schedule", timed(sch.schedule, "schedule")),
               (runner, "run", timed(runner.run, "run_host", "run_device")),
               (runner, "launch_next", timed(runner.launch_next, "run_host", "run_device"))]
    sample = core.sample
    try:  # instance attributes shadow the methods until deleted below
        for obj, name, fn in patched:
            setattr(obj, name, fn)
        core.sample = timed(sample, "sample")
        _sync(dev)
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(dev)
        total = time.perf_counter() - t
    finally:
        core.sample = sample
        for obj, name, _ in patched:
            delattr(obj, name)
    out = {k: 1000 * v / steps for k, v in acc.items()}
    out["step"] = 1000 * total / steps
    out["other"] = out["step"] - sum(acc.values()) * 1000 / steps
    return out


def hf_decode(hf, batch: int, prompt_len: int, new_tokens: int, device: str) -> dict[str, float]:
    ids = torch.tensor(_prompts(batch, prompt_len, hf.config.vocab_size, 1), device=device)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        _sync(device)
        t = time.perf_counter()
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=0, eos_token_id=None)
        _sync(device)
        return time.perf_counter() - t

    run(2)  # warm-up
    # the time of new_tokens - 1 decode steps: the difference of two runs, each the fastest of
    # three on the CPU (a tiny model on a busy 2-core machine: one run of each could come out
    # with the short run slower than the long one)
    reps = 3 if torch.device(device).type == "cpu" else 1
    dt = min(run(new_tokens) for _ in range(reps)) - min(run(1) for _ in range(reps))
    if dt <= 0:
        raise RuntimeError(f"HF generate timing: {new_tokens} tokens took no longer than 1 ({dt:.4f} s); "
                           "the machine is too busy to measure, or new_tokens is too small")
    return {"tokens_per_s": batch * (new_tokens - 1) / dt, "step_ms": 1000 * dt / (new_tokens - 1)}


def roofline(engine: Engine, batch: int, context: float, bw: float, experts_read: float | None = None) -> float:
    """Decode tokens/s if a step only had to read the weights and the batch's K/V once. A MoE
    model's step reads ``experts_read`` experts per sparse layer (those its tokens were routed
    to; default all of them)."""
    cfg = engine.model.cfg
    p = next(engine.model.parameters())
    weights = sum(t.numel() for t in engine.model.parameters())  # tied counted once
    weights -= cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)  # the embedding: B rows
    if cfg.sparse_layers and experts_read is not None:
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        weights -= len(cfg.sparse_layers) * (cfg.num_experts - experts_read) * per_expert
    kv_bytes = batch * context * engine.kv_block_bytes(1)
    return batch / ((weights * p.element_size() + kv_bytes) / bw)


def prefill(engine: Engine, hf, n: int, length: int, device: str) -> dict[str, float]:
    """Prefill tokens/s of ``n`` prompts of ``length`` tokens submitted together, and of HF's
    forward pass over the same batch (``hf`` None: the engine alone)."""
    ps = _prompts(n, length, engine.model.cfg.vocab_size, 7)
    engine.generate(ps[:1], SamplingParams(max_tokens=1))  # warm-up
    engine.blocks.invalidate()
    before = engine.stats()["prefill_seconds"]
    engine.generate(ps, SamplingParams(max_tokens=1))
    dt = engine.stats()["prefill_seconds"] - before
    out = {"engine_tokens_per_s": n * length / dt}
    if hf is None:
        return out
    ids = torch.tensor(ps, device=device)
    with torch.inference_mode():
        hf(ids[:1, :64], logits_to_keep=1)
        _sync(device)
        t = time.perf_counter()
        hf(ids, logits_to_keep=1)
        _sync(device)
    out["hf_tokens_per_s"] = n * length / (time.perf_counter() - t)
    return out


def agent_rollout(engine: Engine, turns: int = 10, system: int = 1000, reply: int = 64, tool: int = 200,
                  repeats: int = 3, concurrent: int = 1, same_task: bool = False,
                  bw: float | None = None) -> dict[str, float]:
    """Total prefill over a multi-turn rollout vs prefilling its last prompt alone.

    ``concurrent`` rollouts run in lockstep (each turn's prompts submitted together, as an
    RL actor's group of rollouts on one engine); their last prompts are then prefilled alone,
    together. ``same_task``: they start from one first prompt (a GRPO group: k rollouts of
    one task), else each from its own. The rollout and the last-prompt-alone prefill are
    each run ``repeats`` times (prefix cache cleared before each) and compared by their
    medians: one run of each moved the ratio by up to 1.8x between H100 machines for the
    0.5B shape. A single rollout also reports ``gemm_bound`` (``bw``: the copy bandwidth,
    measured here if not given)."""
    import statistics

    vocab = engine.model.cfg.vocab_size
    g = torch.Generator().manual_seed(3)
    rand = lambda k: torch.randint(0, vocab, (k,), generator=g).tolist()
    # warm-up: the first prefill of a new length also loads its GEMM kernels (it cost ~12 ms
    # in a measured run)
    engine.generate([rand(system) for _ in range(concurrent)], SamplingParams(max_tokens=2))
    totals, tokens, hits = [], [], []
    for _ in range(repeats):
        engine.blocks.invalidate()
        s0 = engine.stats()
        first = rand(system)
        histories = [list(first) if same_task else rand(system) for _ in range(concurrent)]
        turn_tokens = []  # tokens each turn prefilled (the last repeat's are kept)
        for _turn in range(turns):
            # plain sampling (no per-request seed), as the last-prompt-alone run: a seeded row is
            # sampled outside the graph, a cost of sampling, not of prefill
            before = engine.stats()["prefill_tokens_computed"]
            outs = engine.generate(histories, SamplingParams(max_tokens=reply, temperature=1.0))
            turn_tokens.append(engine.stats()["prefill_tokens_computed"] - before)
            last_prompts = [list(h) for h in histories]
            histories = [h + c.token_ids + rand(tool) for h, c in zip(histories, outs)]
        s1 = engine.stats()
        totals.append(s1["prefill_seconds"] - s0["prefill_seconds"])
        tokens.append(s1["prefill_tokens_computed"] - s0["prefill_tokens_computed"])
        hits.append(s1["prefix_cache_hit_tokens"] - s0["prefix_cache_hit_tokens"])
    alone_s = prefill_alone(engine, last_prompts, repeats)
    total_s, alone = statistics.median(totals), statistics.median(alone_s)
    last_tokens = sum(map(len, last_prompts))
    out = {"turns": turns, "concurrent": concurrent, "same_task": same_task, "repeats": repeats,
           "last_prompt_tokens": last_tokens,
           "total_prefill_tokens": tokens[-1], "ratio_tokens": tokens[-1] / last_tokens,
           "total_prefill_s": total_s, "last_alone_prefill_s": alone, "ratio_seconds": total_s / alone,
           "ratio_seconds_min": min(totals) / max(alone_s), "ratio_seconds_max": max(totals) / min(alone_s),
           "cache_hit_tokens": hits[-1]}
    if concurrent == 1:  # one step per turn: what its matrix multiplies alone would give
        out.update(gemm_bound(engine, turn_tokens, last_tokens, bw or bandwidth(str(engine.device))))
    return out


def gemm_bound(engine: Engine, steps: list[int], alone: int, bw: float) -> dict[str, float]:
    """The rollout's ratio if only its matrix multiplies took time, and its floor.

    For a single rollout (one prefill step per turn, ``steps`` new tokens each) and its last
    prompt alone (one step of ``alone`` tokens): every layer's projections and the lm_head,
    timed alone at the rows each step runs them at (``projection_ms``). With attention, the
    element-wise kernels and the host free, the ratio would be ``ratio_gemm_only``: a bound
    set by the GEMM library. ``ratio_floor`` is the same where each step's multiplies take
    the larger of reading the weights at the copy bandwidth ``bw`` and their FLOPs at the rate the
    largest step's GEMMs reached -- a bound set by the GPU."""
    rows = {n: _prefill_rows(engine, n) for n in set(steps) | {alone}}
    times = {m: projection_ms(engine.model, *m) for m in set(rows.values())}
    total = lambda f: sum(f(rows[n]) for n in steps)
    gemm_ms = lambda m: sum(times[m].values())
    cfg = engine.model.cfg
    shapes = cfg.projection_shapes()
    head = shapes.pop("lm_head")
    layer = sum(n * k for n, k in shapes.values())  # one layer's projection weights
    flops = lambda m: 2 * (m[0] * cfg.num_layers * layer + m[1] * head[0] * head[1])
    peak = flops(rows[alone]) / (gemm_ms(rows[alone]) / 1e3)  # FLOP/s the last-alone step's GEMMs reached
    elem = next(engine.model.parameters()).element_size()
    read_s = (cfg.num_layers * layer + head[0] * head[1]) * elem / bw
    floor = lambda m: max(read_s, flops(m) / peak)
    return {"gemm_only_total_ms": total(gemm_ms), "gemm_only_alone_ms": gemm_ms(rows[alone]),
            "ratio_gemm_only": total(gemm_ms) / gemm_ms(rows[alone]),
            "gemm_alone_tflops": peak / 1e12, "weights_read_ms": 1e3 * read_s,
            "ratio_floor": total(floor) / floor(rows[alone])}


def _prefill_rows(engine: Engine, n: int) -> tuple[int, int]:
    """(token rows, lm_head rows) a one-sequence prefill step of ``n`` tokens multiplies:
    the graph bucket's and its sequence slots, or ``n`` and 1 when it runs eagerly."""
    runner = engine.runner
    bucket = runner.prefill_bucket(n)
    return (bucket, runner.prefill_seqs) if bucket in runner.prefill_graphs else (n, 1)


def projection_ms(model, m: int, head_rows: int = 1, linear=F.linear) -> dict[str, float]:
    """Milliseconds of each projection of a ``DecoderLM`` over all layers at ``m`` rows, each
    layer on its own weights (as a forward pass runs them: from HBM, not L2), and of the
    lm_head at ``head_rows``; CUDA-graph timed on CUDA, wall-clock medians elsewhere.
    ``linear(x, weight, bias)`` is the multiply timed (another GEMM library, say)."""
    cfg, p = model.cfg, next(model.parameters())
    layers = list(model.model.layers)
    new = lambda r, c: torch.randn(r, c, device=p.device, dtype=p.dtype)
    x, a, i = new(m, cfg.hidden_size), new(m, cfg.num_heads * cfg.head_dim), new(m, cfg.intermediate_size)
    run = lambda inp, mods: [linear(inp, mod.weight, mod.bias) for mod in mods]
    ops = {"qkv": lambda: run(x, [li.self_attn.qkv_proj for li in layers]),
           "o": lambda: run(a, [li.self_attn.o_proj for li in layers]),
           "gate_up": lambda: run(x, [li.mlp.gate_up_proj for li in layers]),
           "down": lambda: run(i, [li.mlp.down_proj for li in layers]),
           "lm_head": lambda: run(x[:head_rows], [model.lm_head])}
    with torch.inference_mode():
        return {role: time_ms(op, p.device) for role, op in ops.items()}


def prefill_alone(engine: Engine, prompts: list[list[int]], repeats: int = 3) -> list[float]:
    """Prefill seconds of ``prompts`` submitted together on an empty prefix cache (the
    engine's own counter: steps' wall time up to their sampled tokens), ``repeats`` times."""
    out = []
    for _ in range(repeats):
        engine.blocks.invalidate()
        before = engine.stats()["prefill_seconds"]
        engine.generate(prompts, SamplingParams(max_tokens=1))
        out.append(engine.stats()["prefill_seconds"] - before)
    engine.blocks.invalidate()
    return out


def logprob_parity(shape: str, device: str, dtype: torch.dtype, n: int = 8, tokens: int = 32,
                   kernels: str | None = None) -> dict[str, float]:
    hf = random_model(shape, device, dtype)
    engine = Engine(hf, None, max_num_seqs=n, max_model_len=256, device=device, dtype=dtype, kernels=kernels)
    ps = _prompts(n, 48, hf.config.vocab_size, 11)
    outs = engine.generate(ps, SamplingParams(max_tokens=tokens, temperature=1.0, seed=5))
    diffs = []
    with torch.inference_mode():
        for p, c in zip(ps, outs):
            logits = hf(torch.tensor([p + c.token_ids], device=device)).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids, device=device)[:, None])[:, 0]
            diffs.append((ref.cpu() - torch.tensor(c.logprobs)).abs())
        greedy = engine.generate(ps[:4], SamplingParams(max_tokens=16, temperature=0))
        same = 0
        for p, c in zip(ps[:4], greedy):
            ids = torch.tensor([p], device=device)
            ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                              do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
            same += ref == c.token_ids
    d = torch.cat(diffs)
    del engine, hf
    return {"mean_abs_diff": d.mean().item(), "max_abs_diff": d.max().item(), "tokens": d.numel(),
            "greedy_identical": f"{same}/4"}



def run(shapes: list[str], device: str = "cuda", dtype: str = "bfloat16", batches: tuple[int, ...] = (1, 64, 256),
        hf_batches: tuple[int, ...] = (1, 64), prompt_len: int = 128, decode_steps: int = 128,
        prefill_batch: int = 8, prefill_len: int = 2048, rollout: dict[str, int] | None = None,
        parity: bool = True, kernels: str | None = None, contexts: tuple[int, ...] | None = None,
        seeded: bool = False, decode_only: bool = False, max_model_len: int | None = None,
        phase_steps: int = 0, busy_threads: int = 0, switch_ms: float | None = None,
        cuda_graphs: bool | str = True, log=print) -> dict[str, Any]:
    """Every figure of the module docstring, as one dict. ``contexts``: prompt tokens per
    sequence before decode, each timed at every batch size (``decode_b{b}_ctx{c}``; default:
    ``prompt_len`` alone, ``decode_b{b}``); ``seeded``: requests seeded as an RL rollout's;
    ``decode_only``: the decode figures alone (no parity, HF, prefill or prefix-cache runs);
    ``max_model_len``: the engine's (default: the smallest that holds the longest context;
    RL rollout engines use ``AGENT_CONTEXT``, and the decode graphs' block tables are that
    wide); ``phase_steps``: steps split into host and device parts (``step_phases``);
    ``busy_threads`` / ``switch_ms``: decode timed beside that many pure-Python threads, with
    that switch interval (``python_load``: an RL actor's episode threads)."""
    if contexts is not None and (not contexts or min(contexts) < 1):
        raise ValueError(f"contexts: expected prompt lengths >= 1, got {contexts}")
    if decode_only:
        parity = False
    dt = getattr(torch, dtype)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
                              "dtype": dtype, "torch": torch.__version__}
    bw = bandwidth(device)
    result["bandwidth_GBps"] = round(bw / 1e9, 1)
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    if parity:
        result["parity"] = {name: logprob_parity(shapes[0], device, d, kernels=kernels)
                            for name, d in {"float32": torch.float32, dtype: dt}.items()}
        log(f"parity {result['parity']}")
    for shape in shapes:
        r: dict[str, Any] = {}
        hf = random_model(shape, device, dt)
        lengths = contexts or (prompt_len,)
        max_len = max_model_len or max(lengths) + decode_steps + phase_steps + 8
        if max_len < max(lengths) + decode_steps + phase_steps + 8:
            raise ValueError(f"max_model_len={max_len} cannot hold a context of {max(lengths)} tokens and "
                             f"{decode_steps + phase_steps + 8} more")
        t = time.perf_counter()
        engine = Engine(hf, None, max_num_seqs=max(batches), max_model_len=max_len, device=device, dtype=dt,
                        kernels=kernels, cuda_graphs=cuda_graphs)
        st = engine.stats()
        # (the first engine of a process on a machine also compiles the Triton kernels, unless cached)
        # 4 decimals: a CPU engine of a tiny shape starts in milliseconds, which 2 would report as 0
        r["startup"] = {"seconds": round(time.perf_counter() - t, 4), "parts_s": st["graph_capture_s"],
                        "graph_memory_MiB": round(st["graph_memory_bytes"] / 2**20, 1),
                        "decode_graphs": len(st["cuda_graph_batch_sizes"]), "prefill_graphs": st["prefill_graphs"]}
        log(f"{shape} engine start-up: {r['startup']}")
        t = time.perf_counter()
        r["params_M"] = round(sum(p.numel() for p in engine.model.parameters()) / 1e6, 1)
        r["max_model_len"], r["seeded"], r["busy_threads"], r["switch_ms"] = max_len, seeded, busy_threads, switch_ms
        for b in batches:
            for c in lengths:
                with python_load(busy_threads, switch_ms):
                    e = engine_decode(engine, b, c, decode_steps, seeded=seeded, phase_steps=phase_steps)
                e["roofline_tokens_per_s"] = roofline(engine, b, e["mean_context"], bw)
                e["fraction_of_roofline"] = e["tokens_per_s"] / e["roofline_tokens_per_s"]
                key = f"decode_b{b}" if contexts is None else f"decode_b{b}_ctx{c}"
                r[key] = _figures(e)
                log(f"{shape} engine decode {key}: {r[key]}")
        assert engine.stats()["kv_blocks_used"] == 0, engine.stats()
        st = engine.stats()
        r["kernels"] = st["kernels"]
        r["gemv_batch1"], r["capture_b1_ms"], r["gemv_plan"] = st["gemv_batch1"], st["capture_b1_ms"], st["gemv_plan"]
        del engine
        if decode_only:
            del hf
            result[shape] = r
            continue
        if device.startswith("cuda") and r["kernels"] != "torch":  # the same with the portable torch kernels
            engine = Engine(hf, None, max_num_seqs=max(batches), max_model_len=max_len, device=device, dtype=dt,
                            kernels="torch")
            for b in (min(batches), max(batches)):
                e = engine_decode(engine, b, lengths[0], decode_steps, seeded=seeded)
                r[f"decode_b{b}_torch_kernels"] = _figures(e)
            del engine
        for b in (b for b in hf_batches if b in batches and contexts is None):
            h = hf_decode(hf, b, prompt_len, 64, device)
            r[f"hf_decode_b{b}"] = _figures(h)
            r[f"speedup_vs_hf_b{b}"] = round(r[f"decode_b{b}"]["tokens_per_s"] / h["tokens_per_s"], 2)
            log(f"{shape} HF generate b{b}: {r[f'hf_decode_b{b}']}")
        ro = rollout or {}
        long_len = max(prefill_len, ro.get("system", 1000) + 10 * (ro.get("reply", 64) + ro.get("tool", 200))) + 128
        engine = Engine(hf, None, max_num_seqs=prefill_batch, max_model_len=long_len, device=device, dtype=dt,
                        max_num_batched_tokens=8192)
        r["prefill"] = {k: round(v, 1) for k, v in prefill(engine, hf, prefill_batch, prefill_len, device).items()}
        log(f"{shape} prefill: {r['prefill']}")
        # one rollout alone; a group in lockstep (each turn's prompts prefilled in one step); a
        # GRPO group, whose rollouts share their first prompt (computed once, in one step)
        group = {"concurrent": prefill_batch}
        for key, extra in (("", {}), (f"_x{prefill_batch}", group),
                           (f"_x{prefill_batch}_same_task", {**group, "same_task": True})):
            res = r[f"prefix_cache_10_turns{key}"] = {k: _r4(v) for k, v in
                                                      agent_rollout(engine, **{**ro, **extra}, bw=bw).items()}
            log(f"{shape} 10-turn rollout{key}: {res}")
        assert engine.stats()["kv_blocks_used"] == 0, engine.stats()
        r["seconds"] = round(time.perf_counter() - t, 1)
        del engine, hf
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        result[shape] = r
    return result


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--kernels", default=None, help="triton (CUDA default) or torch")
    ap.add_argument("--context", default=None, help="prompt tokens per sequence before decode, comma-separated")
    ap.add_argument("--seeded", action="store_true")
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--phase-steps", type=int, default=0)
    ap.add_argument("--busy-threads", type=int, default=0)
    ap.add_argument("--switch-ms", type=float, default=None)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    res = run(a.shapes.split(","), a.device, a.dtype, tuple(int(b) for b in a.batches.split(",")),
              decode_steps=a.decode_steps, kernels=a.kernels,
              contexts=tuple(int(c) for c in a.context.split(",")) if a.context else None, seeded=a.seeded,
              decode_only=a.decode_only, max_model_len=a.max_model_len, phase_steps=a.phase_steps,
              busy_threads=a.busy_threads, switch_ms=a.switch_ms)
    emit(res, a.out)


if __name__ == "__main__":
    main()
