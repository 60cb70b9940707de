"""Where an RL update's time goes on the host: torch ops an update and micro-batches, by layout
(``[train] pack_sequences``) and budget (``[train] micro_batch_tokens``), at the long run's sample shape.

    python benchmarks/rl_update_host.py [--config configs/learn/gpu-lines-more.toml] \\
        [--budgets 16384,65536,131072] [--samples 140] [--measured-s 13.2]

Samples (seeded): ``--samples`` of 1.2k-8k tokens, log-normal around 2.7k (the long run's rows: ~140
samples and ~420k tokens an update), each a 1.1k-token shared prompt, then turns of a 60-250-token
completion (the loss tokens) and a 100-900-token tool output. For each layout and budget, exactly,
through the trainer's own grouping and collation: micro-batches, tokens the forward computes (padding
included), head positions (rows x kept positions: where the vocabulary-wide log-probs are taken) per
loss token, and the largest micro-batch's fp32 logits in GiB.

Ops: the update itself (the trainer's RL backward and optimizer step, with the config's ``[train]``,
LoRA when ``[learn] rl_lora``, activation checkpointing off as on a GPU) under torch.profiler, on a
model of the embedded model's structure (its layers, heads and LoRA targets) made narrow (hidden 64,
vocabulary 512) with the samples 1/16 as long and the budgets 1/16 as large: the same micro-batches
and documents, so the same ops (a count that depends on neither width nor length), while the CPU
runs it in seconds; ``update_s_cpu`` is that narrow update's wall time on this CPU, nearly all of it
dispatch. ``host_s`` = ops x the per-op cost that makes the first layout and budget take
``--measured-s`` (the long run's update alone on one H200, session 44's step 25: 13.2 s at padded
16,384): what each layout would cost a host-bound GPU update. Last line: one JSON object.

Test: ``pytest tests/bench/test_rl_update_host.py``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learn_run import config_with, sub_config  # noqa: E402

from opencomposer.models.registry import load_model  # noqa: E402
from opencomposer.train.loss import LossConfig  # noqa: E402
from opencomposer.train.micro_batches import collate, group_samples  # noqa: E402
from opencomposer.train.samples import Sample  # noqa: E402
from opencomposer.train.trainer import Trainer  # noqa: E402

SCALE = 16  # the narrow run's lengths and budgets, divided
VOCAB = 49152  # the embedded model's, for the logits' size
NARROW_VOCAB = 512


def long_run_samples(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` of ``n`` samples shaped as the long run's (module docstring)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = max(1200, min(8000, int(rng.lognormvariate(7.9, 0.45))))
        ids, mask = [rng.randrange(3, NARROW_VOCAB) for _ in range(1100)], [0] * 1100
        while len(ids) < length:
            c, o = rng.randint(60, 250), rng.randint(100, 900)
            ids += [rng.randrange(3, NARROW_VOCAB) for _ in range(c + o)]
            mask += [1] * c + [0] * o
        out.append((ids[:length], mask[:length]))
    return out


def as_samples(shapes: list[tuple[list[int], list[int]]], scale: int) -> list[Sample]:
    """Samples of those shapes, every ``scale``-th token kept (the same turns, 1/scale as long)."""
    out = []
    for i, (ids, mask) in enumerate(shapes):
        ids, mask = ids[::scale], mask[::scale]
        mask[0] = 0  # the first token has no context
        out.append(Sample(ids, mask, [-1.0 if m else 0.0 for m in mask], advantage=0.5 if i % 2 else -0.5,
                          policy_version=[0 if m else -1 for m in mask], group_id=f"g{i // 8}"))
    return out


def layout(samples: list[Sample], budget: int, packed: bool) -> dict:
    """Micro-batches, computed tokens, head positions and the largest logits, exactly (full length)."""
    groups = group_samples(samples, budget, packed, False)
    loss = sum(s.loss_tokens for s in samples)
    head = computed = peak = 0
    for g in groups:
        b = collate(g, 0, torch.device("cpu"), packed)
        rows_keep = b.ids.shape[0] * len(b.keep)
        head, computed, peak = head + rows_keep, computed + b.ids.numel(), max(peak, rows_keep)
    return {"micro_batches": len(groups), "tokens_computed": computed, "head_per_loss_token": round(head / loss, 2),
            "peak_logits_gib_fp32": round(peak * VOCAB * 4 / 2**30, 2)}


def narrow_model(layers: int, pad_id: int) -> LlamaForCausalLM:
    """The embedded model's structure (its layer count, grouped-query attention, tied head), narrow."""
    cfg = LlamaConfig(vocab_size=NARROW_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      tie_word_embeddings=True, pad_token_id=pad_id)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def update_ops(samples: list[Sample], train_cfg, loss_cfg: LossConfig, layers: int, tokenizer) -> tuple[int, float]:
    """Torch ops and CPU wall seconds of one RL update (backward over every micro-batch + optimizer step)."""
    trainer = Trainer(narrow_model(layers, tokenizer.pad_token_id or 0), tokenizer, train_cfg)
    trainer.rl_backward(samples[:2], loss_cfg, 8000.0)  # warm: first-call set-up is not an update's cost
    trainer.optimizer_step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.rl_backward(samples, loss_cfg, 8000.0)
        trainer.optimizer_step()
    wall = time.perf_counter() - t0
    return int(sum(e.count for e in prof.key_averages())), wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/learn/gpu-lines-more.toml")
    ap.add_argument("--budgets", default="16384,65536,131072", help="micro_batch_tokens to read, comma-separated")
    ap.add_argument("--samples", type=int, default=140)
    ap.add_argument("--layers", type=int, default=None, help="default: the embedded model's (30)")
    ap.add_argument("--measured-s", type=float, default=13.2,
                    help="the first layout's update alone on the GPU, to price an op (session 44: 13.2 s)")
    a = ap.parse_args(argv)
    try:
        budgets = [int(b) for b in a.budgets.split(",")]
    except ValueError:
        raise SystemExit(f"--budgets {a.budgets!r}: expected comma-separated token counts, e.g. 16384,65536") from None
    if any(b < SCALE * 64 for b in budgets) or a.samples < 2:
        raise SystemExit(f"--budgets {budgets}: each at least {SCALE * 64} tokens; --samples at least 2")
    cfg = config_with(a.config, ['model.device="cpu"'])
    _, tokenizer = load_model("tiny-random")  # its pad id; the narrow model has its own weights
    layers = a.layers or 30  # SmolLM2-135M's
    shapes = long_run_samples(a.samples)
    full, narrow = as_samples(shapes, 1), as_samples(shapes, SCALE)
    loss_cfg = LossConfig(**cfg.loss.loss_kwargs())
    rows, per_op = [], None
    for packed in (cfg.train.pack_sequences, not cfg.train.pack_sequences):
        for budget in budgets:
            tcfg = sub_config(cfg, Path("/tmp/rl-update-host"), lora=cfg.learn.rl_lora).train
            tcfg = tcfg.model_copy(update={"micro_batch_tokens": budget // SCALE, "pack_sequences": packed,
                                           "gradient_checkpointing": False, "bf16": False})
            row = {"layout": "packed" if packed else "padded", "micro_batch_tokens": budget,
                   **layout(full, budget, packed)}
            ops, wall = update_ops(narrow, tcfg, loss_cfg, layers, tokenizer)
            per_op = per_op or a.measured_s / ops  # priced by the first (the config's own) layout and budget
            passes = len(group_samples(narrow, budget // SCALE, packed, False))  # the narrow run's (~ the full's)
            row.update(ops=ops, ops_per_micro_batch=round(ops / passes), update_s_cpu=round(wall, 2),
                       host_s=round(ops * per_op, 2))
            rows.append(row)
            print(f"{row['layout']:>6} @ {budget:>6}: {row['micro_batches']:>3} micro-batches, {ops:>9,} ops "
                  f"({row['ops_per_micro_batch']:,} each), head {row['head_per_loss_token']}x the loss tokens, "
                  f"logits <= {row['peak_logits_gib_fp32']} GiB, host ~{row['host_s']} s", flush=True)
    print(json.dumps({"config": a.config, "samples": a.samples, "tokens": sum(len(s) for s in full),
                      "loss_tokens": sum(s.loss_tokens for s in full), "layers": layers,
                      "us_per_op": round(per_op * 1e6, 2), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
