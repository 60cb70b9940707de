"""SFT of a model on this machine: tokens/s and peak resident memory of the pre-issue-32 trainer
path (right-padded rows, all kept logits at once, no activation checkpointing) against today's
(packed rows, chunked head, checkpointing, shared prefixes), on the same batches from the same weights.
tokens/s counts every sample's tokens (a shared prefix in each sample that holds it).

    opencomposer bench train                                   # the embedded model, 8k-token micro-batches
    opencomposer bench train --model tiny-random --tokens 512 --steps 1 --warmup 0   # a quick check
    opencomposer bench train --device cuda --tokens 16384 --arms baseline,packed_whole,shared_whole,shared

On a GPU (``--device cuda``) each step is timed to the end of its kernels and the peak of
allocated GPU memory is reported too; bf16 autocast where native, so losses agree to bf16's
precision there, not fp32's.

Batches are synthetic token ids shaped like oracle SFT transcripts (the same 1,100-token system
prompt with the tools in every sample, as the harness's, then a 40-200-token task prompt, then
turns of a 60-160-token assistant message, the loss tokens, and a 50-400-token tool result;
1.5k-3k tokens a sample, ~20% loss tokens, as the HumanEval oracle traces are), and
each optimizer step trains samples filling one ``--tokens`` micro-batch of the packed path. Each
arm runs in a fresh process (``ru_maxrss`` is a process's high-water mark), ``--warmup`` steps
then ``--steps`` timed ones; the losses of each step must agree across arms (same weights,
same samples: only the float summation order differs). Each arm's model FLOPs (6 x matmul
parameters + attention, ``bench.fsdp``'s count, each sample whole) over its time give its rate,
set against this machine's matmul rate measured in the same run (``gemm_peak_gflops``: fp32 on
the CPU, bf16 on a GPU): ``ceiling`` is the tokens/s if every model FLOP ran at that rate, and
what share of it 3x the first arm would need. Last line: one JSON object.

Test: ``pytest tests/bench/test_train_bench.py``.
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import time
from typing import Any, Callable

ARMS: dict[str, dict[str, Any]] = {
    "baseline": {"pack_sequences": False, "logits_chunk_tokens": 0, "gradient_checkpointing": False,
                 "return_host_memory": False},
    "packed_chunked": {"pack_sequences": True, "share_prefixes": False, "logits_chunk_tokens": 1024,
                       "gradient_checkpointing": False},
    "packed_chunked_ckpt": {"pack_sequences": True, "share_prefixes": False, "logits_chunk_tokens": 1024,
                            "gradient_checkpointing": True},
    "shared": {"pack_sequences": True, "share_prefixes": True, "logits_chunk_tokens": 1024,
               "gradient_checkpointing": False},
    "shared_ckpt": {"pack_sequences": True, "share_prefixes": True, "logits_chunk_tokens": 1024,
                    "gradient_checkpointing": True},
    # for GPUs, where memory is plenty and the head's recomputation is only cost
    "packed_whole": {"pack_sequences": True, "share_prefixes": False, "logits_chunk_tokens": 0,
                     "gradient_checkpointing": False},
    "shared_whole": {"pack_sequences": True, "share_prefixes": True, "logits_chunk_tokens": 0,
                     "gradient_checkpointing": False},
}
SYSTEM_TOKENS = 1100  # the harness's system prompt and tool schemas: the same first tokens in every sample


def oracle_like_samples(n_tokens: int, vocab: int, seed: int, scale: float = 1.0) -> list[Any]:
    """Samples of about ``n_tokens`` in all, shaped like oracle SFT transcripts (module docstring);
    ``scale`` shrinks every span (a tiny model's short context)."""
    from opencomposer.train.samples import Sample

    rng = random.Random(seed)

    def span(lo: int, hi: int) -> int:
        return max(1, int(rng.randint(lo, hi) * scale))

    system = [random.Random(-1).randrange(vocab) for _ in range(max(1, int(SYSTEM_TOKENS * scale)))]
    samples, total = [], 0
    while True:
        task = span(40, 200)  # the task's prompt: different in every sample
        ids = system + [rng.randrange(vocab) for _ in range(task)]
        mask = [0] * len(ids)
        for turn in range(rng.randint(2, 5)):
            if turn:
                tool = span(50, 400)
                ids += [rng.randrange(vocab) for _ in range(tool)]
                mask += [0] * tool
            reply = span(60, 160)
            ids += [rng.randrange(vocab) for _ in range(reply)]
            mask += [1] * reply
        if total + len(ids) > n_tokens and samples:
            return samples
        samples.append(Sample(input_ids=ids, loss_mask=mask, old_logprobs=[0.0] * len(ids)))
        total += len(ids)


def run_arm(arm: str, model_name: str, tokens: int, steps: int, warmup: int, lr: float, seed: int,
            device: str = "cpu") -> dict[str, Any]:
    """One arm in this process: build the trainer, train ``warmup + steps`` SFT steps."""
    import torch

    from opencomposer.models import load_model
    from opencomposer.train.config import TrainConfig
    from opencomposer.train.trainer import Trainer

    torch.manual_seed(seed)
    model, tok = load_model(model_name, device=device)
    cuda = device.startswith("cuda")
    loaded_rss = _rss_mb()
    cfg = TrainConfig(lr=lr, micro_batch_tokens=tokens, **ARMS[arm])
    trainer = Trainer(model, tok, cfg, name=model_name)
    scale = min(1.0, model.config.max_position_embeddings / 3200)
    losses, seconds, n_tokens, passes = [], [], 0.0, 0
    for step in range(warmup + steps):
        batch = oracle_like_samples(tokens, model.config.vocab_size, seed + step, scale)
        t0 = time.perf_counter()
        m = trainer.sft_step(batch)
        if cuda:
            torch.cuda.synchronize()  # the step's kernels done, not only queued
        losses.append(round(m["loss"], 6))
        if step >= warmup:
            seconds.append(time.perf_counter() - t0)
            n_tokens += m["tokens"]
            passes += len(trainer._micro_batches(batch))
    total = sum(seconds)
    work = step_work(trainer, model, [oracle_like_samples(tokens, model.config.vocab_size, seed + step, scale)
                                      for step in range(warmup, warmup + steps)])
    return {"arm": arm, "settings": ARMS[arm], "tokens_per_second": round(n_tokens / total, 1) if total else 0.0,
            **work, "achieved_gflops": round(work["model_gflop"] / total, 2) if total else 0.0,
            "step_seconds": [round(s, 2) for s in seconds], "timed_tokens": int(n_tokens), "forward_passes": passes,
            "losses": losses, "peak_rss_mb": _rss_mb(), "rss_after_load_mb": loaded_rss,
            "threads": torch.get_num_threads(), "device": torch.cuda.get_device_name() if cuda else "cpu",
            "bf16": trainer.bf16,
            **({"peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1)} if cuda else {})}


def step_work(trainer: Any, model: Any, batches: list[list[Any]]) -> dict[str, Any]:
    """The model FLOPs the timed steps' samples need, each sample whole (``bench.fsdp``'s count:
    6 x matmul parameters + causal attention, per sample length; no recomputation, nothing
    shared), and the tokens the arm actually ran through the model (padding included, a shared
    prefix once a row): their ratio is what sharing saves."""
    from opencomposer.bench.fsdp import model_flops_per_token

    flop = sum(model_flops_per_token(model, len(s.input_ids)) * len(s.input_ids) for b in batches for s in b)
    counted = sum(len(s.input_ids) for b in batches for s in b)
    ran = sum(int(trainer._collate(mb).ids.numel()) for b in batches for mb in trainer._micro_batches(b))
    return {"model_gflop": round(flop / 1e9, 1), "model_flop_per_token": round(flop / max(counted, 1)),
            "tokens_run": ran, "run_fraction": round(ran / max(counted, 1), 3)}


def gemm_peak_gflops(device: str = "cpu", n: int = 4096, repeats: int = 3) -> float:
    """This machine's fp32 (CPU) or bf16 (GPU) matmul rate, the best of ``repeats`` n x n
    products with the threads torch uses: the practical ceiling the trainer's matmuls meet."""
    import torch

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return round(2 * n**3 / best / 1e9, 1)


def run(model_name: str, arms: list[str], tokens: int, steps: int, warmup: int, lr: float = 1e-4, seed: int = 0,
        log: Callable[[str], None] = print, device: str = "cpu") -> dict[str, Any]:
    """Every arm in its own process; returns the figures and each arm's speed-up over the first."""
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise ValueError(f"--arms: unknown arm(s) {', '.join(unknown)}; expected some of {','.join(ARMS)}")
    results = []
    for arm in arms:
        log(f"bench train: {arm} ({ARMS[arm]}) ...")
        cmd = [sys.executable, "-m", "opencomposer.bench.train", arm, model_name, str(tokens), str(steps),
               str(warmup), str(lr), str(seed), device]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"bench train arm {arm} failed:\n{out.stderr[-3000:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        gpu = f", peak GPU {res['peak_gpu_mb']} MB" if "peak_gpu_mb" in res else ""
        log(f"  {res['tokens_per_second']} tokens/s ({res['achieved_gflops']} model GFLOP/s), peak RSS "
            f"{res['peak_rss_mb']} MB{gpu}, losses {res['losses']}")
        results.append(res)
    first = results[0]
    peak = gemm_peak_gflops(device)  # after the arms: the machine as they found it, in this run
    per_token = first["model_flop_per_token"]
    for r in results:
        r["speedup"] = round(r["tokens_per_second"] / first["tokens_per_second"], 2) if first["tokens_per_second"] else None
        r["max_loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"], first["losses"]))
        r["mfu_of_gemm_peak"] = round(r["achieved_gflops"] / peak, 3) if peak else None
    # the ceiling: every model FLOP at the measured matmul rate (no recomputation); sharing runs
    # run_fraction of the tokens, which lifts it by 1 / run_fraction (attention counted as if unshared)
    bound = peak * 1e9 / per_token if per_token else 0.0
    best_fraction = min(r["run_fraction"] for r in results)
    ceiling = {"gemm_peak_gflops": peak, "model_flop_per_token": per_token,
               "tokens_per_second_at_gemm_peak": round(bound, 1),
               "tokens_per_second_at_gemm_peak_shared": round(bound / best_fraction, 1) if best_fraction else None,
               "three_x_first_arm": round(3 * first["tokens_per_second"], 1),
               "three_x_needs_fraction_of_peak": round(3 * first["tokens_per_second"] * best_fraction / bound, 3)
               if bound else None}
    log(f"ceiling: matmuls at {peak} GFLOP/s -> {ceiling['tokens_per_second_at_gemm_peak']} tokens/s unshared, "
        f"{ceiling['tokens_per_second_at_gemm_peak_shared']} with the best arm's sharing; 3x the first arm "
        f"({ceiling['three_x_first_arm']}) needs {ceiling['three_x_needs_fraction_of_peak']} of that peak")
    return {"bench": "train", "model": model_name, "device": device, "micro_batch_tokens": tokens, "steps": steps, "warmup": warmup,
            "lr": lr, "arms": results, "ceiling": ceiling, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux


if __name__ == "__main__":  # one arm, in the fresh process ``run`` starts
    arm, name, tokens, steps, warmup, lr, seed, device = sys.argv[1:9]
    print(json.dumps(run_arm(arm, name, int(tokens), int(steps), int(warmup), float(lr), int(seed), device)))
