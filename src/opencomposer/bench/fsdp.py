"""The sharded trainer on GPUs: tokens/s, MFU and memory per GPU at 1, 2, 4 ... ranks, and
the same losses at every world size.

    PYTHONPATH=src python -m opencomposer.bench.fsdp --shape qwen2.5-1.5b --worlds 1,2,4
    PYTHONPATH=src python -m opencomposer.bench.fsdp --shape qwen2.5-7b --worlds 1,4 --checkpointing
    PYTHONPATH=src python -m opencomposer.bench.fsdp --shape qwen2.5-7b --worlds 2 --checkpointing --fp8 off,tensorwise
    PYTHONPATH=src python -m opencomposer.bench.fsdp --shape tiny --worlds 1,2 --device cpu   # a quick check

The driver starts ``torchrun --nproc-per-node W`` once per world size W (each run a fresh
set of processes), every rank builds the same randomly initialised model of a real shape
(``inference.bench.SHAPES``) in fp32 and trains it through ``Trainer`` exactly as SFT does
(``sft_step``: bf16 autocast, FSDP2 with bf16 all-gathers and fp32 reduction, AdamW, the
global batch split over the ranks). Each step trains ``--batch`` sequences of ``--seq-len``
random tokens (the same tokens at every world size), loss on every token.

Reported per world size: tokens/s (median step after ``--warmup``), MFU (model FLOPs,
6 x matmul parameters + attention, over ``world x`` the GPU's dense bf16 peak), the peak
memory any rank allocated, the parameters each rank holds, the first steps' losses (which
must agree across world sizes up to bf16 rounding) and, where it did not fit, the error.
``--fp8 off,tensorwise`` runs every world size once per ``[train] fp8`` setting (``train/fp8.py``) and
reports each FP8 setting's tokens/s over ``off``'s at the same world size (``fp8_speedup``; MFU stays
against the bf16 peak) and its losses' largest relative gap to ``off``'s.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

# dense bf16 tensor-core peaks (vendor datasheets, SXM parts), for MFU
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
EXTRA_SHAPES = {
    "qwen2.5-7b": {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False},
}


def model_flops_per_token(model: Any, seq_len: int) -> float:
    """Training FLOPs a token: 6 x the parameters a token multiplies by (the input embedding
    is a lookup, a tied lm_head a matmul) + causal attention's 6 x layers x seq x hidden."""
    cfg = model.config
    embed = model.get_input_embeddings().weight
    matmul = sum(p.numel() for p in model.parameters()) - embed.numel()
    if getattr(cfg, "tie_word_embeddings", False):
        matmul += embed.numel()
    return 6.0 * matmul + 6.0 * cfg.num_hidden_layers * seq_len * cfg.hidden_size


def profile_step(trainer: Any, samples: list, d: Any, top: int = 14) -> list[str]:
    """One more step under the profiler: where the GPU time goes, the top ops by their own time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.sft_step(samples)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) or 1
    return [f"{e.key[:70]}: {e.self_device_time_total / 1e3:.1f} ms ({100 * e.self_device_time_total / total:.1f}%), "
            f"{e.count} calls" for e in events[:top]] if d.main else []


def worker(args: argparse.Namespace) -> None:
    from opencomposer.bench.toolkit import SHAPES, random_model
    from opencomposer.train.samples import Sample
    from opencomposer.train.config import TrainConfig
    from opencomposer.train.distributed import gather, init_from_env
    from opencomposer.train.trainer import Trainer

    SHAPES.update(EXTRA_SHAPES)
    d = init_from_env(args.device)
    cuda = args.device == "cuda"
    out: dict[str, Any] = {"world": d.world, "shape": args.shape, "fp8": args.fp8}
    try:
        model = random_model(args.shape, "cuda" if cuda else "cpu", torch.float32, seed=0)
        flops_tok = model_flops_per_token(model, args.seq_len)
        total = sum(p.numel() for p in model.parameters())
        cfg = TrainConfig(lr=1e-5, bf16=cuda, micro_batch_tokens=args.micro_batch_tokens,
                          gradient_checkpointing=args.checkpointing, fp8=args.fp8)
        trainer = Trainer(model, SimpleNamespace(pad_token_id=0), cfg, name=args.shape, dist=d)
        held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in trainer.params)
        vocab = model.config.vocab_size
        times, losses = [], []
        for step in range(args.warmup + args.steps):
            g = torch.Generator().manual_seed(1000 + step)
            ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=g).tolist()
            samples = [Sample(input_ids=row, loss_mask=[0] + [1] * (args.seq_len - 1),
                              old_logprobs=[0.0] * args.seq_len) for row in ids]
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = trainer.sft_step(samples)
            if cuda:
                torch.cuda.synchronize()
            losses.append(m["loss"])
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
        if args.profile and cuda:
            out["profile"] = profile_step(trainer, samples, d)
        step_s = statistics.median(times)
        tok_s = args.batch * args.seq_len / step_s
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        name = torch.cuda.get_device_name() if cuda else "cpu"
        peak_flops = next((v for k, v in PEAK_BF16.items() if k in name), None)
        out.update(
            parameters=total, parameters_per_rank=held, device=name, step_s=round(step_s, 4),
            step_s_range=[round(min(times), 4), round(max(times), 4)], tokens_per_step=args.batch * args.seq_len,
            tokens_per_s=round(tok_s, 1),
            mfu=round(flops_tok * tok_s / (d.world * peak_flops), 4) if peak_flops else None,
            losses=[round(x, 6) for x in losses[:3]], peak_memory_gib=peak / 2**30,
        )
    except torch.cuda.OutOfMemoryError as e:
        out["error"] = f"out of memory: {str(e).splitlines()[0]}"
    peaks = gather(out.get("peak_memory_gib", 0.0), d)
    errors = gather(out.get("error"), d)
    if d.main:
        out["peak_memory_gib"] = round(max(peaks), 2)
        if any(errors):
            out = {"world": d.world, "shape": args.shape, "fp8": args.fp8, "error": next(e for e in errors if e)}
        print(json.dumps(out), flush=True)


def drive(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for fp8, w in [(f, int(x)) for f in args.fp8.split(",") for x in args.worlds.split(",")]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={w}", __file__,
               "--worker", *sys.argv[1:], "--fp8", fp8]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(os.getcwd(), "src"),
                                                                        os.environ.get("PYTHONPATH")]))}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        run = json.loads(lines[-1]) if lines else {"world": w, "fp8": fp8, "error": f"exit {proc.returncode}: "
                                                                                   f"{proc.stderr.strip()[-1500:]}"}
        run["wall_s"] = round(time.perf_counter() - t0, 1)
        runs.append(run)
        print(json.dumps(run), flush=True)
    first = args.fp8.split(",")[0]
    ok = [r for r in runs if "error" not in r and r["fp8"] == first]
    summary: dict[str, Any] = {"shape": args.shape, "seq_len": args.seq_len, "batch": args.batch, "runs": runs}
    if ok:
        base = ok[0]
        summary["speedup"] = {r["world"]: round(r["tokens_per_s"] / base["tokens_per_s"], 3) for r in ok}
        summary["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for r in ok for a, b in zip(r["losses"], base["losses"]))
    bf16 = {r["world"]: r for r in runs if "error" not in r and r["fp8"] == "off"}
    low = [r for r in runs if "error" not in r and r["fp8"] != "off" and r["world"] in bf16]
    if low:  # each FP8 run against the bf16 one at its world size
        summary["fp8_speedup"] = {f"{r['fp8']}@{r['world']}": round(r["tokens_per_s"] / bf16[r["world"]]["tokens_per_s"], 3)
                                  for r in low}
        summary["fp8_loss_max_rel_diff"] = {
            f"{r['fp8']}@{r['world']}": round(max(abs(a - b) / abs(b) for a, b in zip(r["losses"], bf16[r["world"]]["losses"])), 5)
            for r in low}
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--worlds", default="1,2", help="world sizes to run, e.g. 1,2,4")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16, help="sequences per optimizer step (global)")
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    ap.add_argument("--fp8", default="off", help="[train] fp8 settings to run, comma-separated (off, tensorwise, "
                    "rowwise), each at every world size")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--profile", action="store_true", help="one more step under torch.profiler (CUDA)")
    ap.add_argument("--timeout", type=float, default=560.0, help="seconds per world size")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
    else:
        print(json.dumps(drive(args)))


if __name__ == "__main__":
    main()
