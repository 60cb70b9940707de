"""SFT of a model on this machine: tokens/s and peak resident memory of the pre-issue-32 trainer
path (right-padded rows, all kept logits at once, no activation checkpointing) against today's
(packed rows, chunked head, checkpointing, shared prefixes), on the same batches from the same weights.
tokens/s counts every sample's tokens (a shared prefix in each sample that holds it).

    opencomposer bench train                                   # the embedded model, 8k-token micro-batches
    opencomposer bench train --model tiny-random --tokens 512 --steps 1 --warmup 0   # a quick check
    opencomposer bench train --device cuda --tokens 16384 --arms baseline,packed_whole,shared_whole,shared
    opencomposer bench train --device cuda --model shape:qwen2.5-1.5b --batches dense --tokens 16384 --arms hf,packed_whole,packed_flex
    opencomposer bench train --device cuda --model shape:qwen2.5-1.5b --batches rl --tokens 16384 --arms hf,shared_whole,shared_flex
    opencomposer bench train --device cuda --model shape:qwen2.5-1.5b --batches dense --tokens 16384 --arms packed_whole,packed_fp8,packed_fp8_rowwise

Batches (``--batches``): ``oracle`` (below), ``rl`` (GRPO groups of 8 rollouts sharing their
first prompt, advantages of either sign, timed through the trainer's RL step) or ``dense``
(full windows of min(--tokens, the model's context) tokens, a loss on every token). Arm ``hf``
is the plain baseline: the model's own forward with labels on right-padded rows, backward,
``torch.optim.AdamW`` (``PlainHF``). Arms ``packed_whole`` and ``shared_whole`` attend with SDPA a
document (``[train] document_attention = "sdpa"``), ``packed_flex`` and ``shared_flex`` with one
FlexAttention kernel a layer (``"flex"``, CUDA only), the others as the trainer's default (``"auto"``:
flex on CUDA with shared prefixes, else sdpa). ``--model shape:NAME``: random weights of a real shape
(``qwen2.5-1.5b``, ``qwen2.5-7b``...). On a GPU ``mfu`` is an arm's model FLOPs over the card's
dense bf16 peak (``bench.fsdp.PEAK_BF16``), FP8 arms included, so the arms compare.

FP8 (``[train] fp8``, ``train/fp8.py``): ``packed_fp8`` / ``packed_fp8_rowwise`` are ``packed_whole`` and
``shared_flex_fp8`` is ``shared_flex`` with float8 GEMMs in the decoder's linear layers (tensorwise /
rowwise scales); put the bf16 arm first to read the speed-up, e.g. ``--arms packed_whole,packed_fp8,
packed_fp8_rowwise``. On a device without FP8 GEMMs (a CPU, a GPU older than compute capability 8.9)
such an arm is skipped with the reason (``skipped_arms``); ``OPENCOMPOSER_FP8_ALLOW_CPU=1`` runs it on a
CPU, for tests. An FP8 arm's losses differ from bf16's by float8 rounding (``max_loss_diff``).

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
    # for GPUs, where memory is plenty and the head's recomputation is only cost; SDPA a document
    # (the CPU's document attention) against one FlexAttention kernel a layer (CUDA's by default)
    "packed_whole": {"pack_sequences": True, "share_prefixes": False, "logits_chunk_tokens": 0,
                     "gradient_checkpointing": False, "document_attention": "sdpa"},
    "shared_whole": {"pack_sequences": True, "share_prefixes": True, "logits_chunk_tokens": 0,
                     "gradient_checkpointing": False, "document_attention": "sdpa"},
    "packed_flex": {"pack_sequences": True, "share_prefixes": False, "logits_chunk_tokens": 0,
                    "gradient_checkpointing": False, "document_attention": "flex"},
    "shared_flex": {"pack_sequences": True, "share_prefixes": True, "logits_chunk_tokens": 0,
                    "gradient_checkpointing": False, "document_attention": "flex"},
}
# FP8 GEMMs in the decoder's linear layers (train/fp8.py), against the bf16 arm of the same rows:
# packed_whole (dense batches) and shared_flex (RL batches). Skipped where FP8 does not run.
ARMS |= {"packed_fp8": {**ARMS["packed_whole"], "fp8": "tensorwise"},
         "packed_fp8_rowwise": {**ARMS["packed_whole"], "fp8": "rowwise"},
         "shared_flex_fp8": {**ARMS["shared_flex"], "fp8": "tensorwise"}}
SYSTEM_TOKENS = 1100  # the harness's system prompt and tool schemas: the same first tokens in every sample


def _spans(rng: random.Random, scale: float) -> Callable[[int, int], int]:
    def span(lo: int, hi: int) -> int:
        return max(1, int(rng.randint(lo, hi) * scale))
    return span


def _system(vocab: int, scale: float) -> list[int]:
    """The same first tokens in every sample: the harness's system prompt and tool schemas."""
    return [random.Random(-1).randrange(vocab) for _ in range(max(1, int(SYSTEM_TOKENS * scale)))]


def _turns(rng: random.Random, span: Callable[[int, int], int], vocab: int) -> tuple[list[int], list[int]]:
    """2-5 turns: a 60-160-token assistant message (the loss tokens), and between two of them a
    50-400-token tool result."""
    ids: list[int] = []
    mask: list[int] = []
    for turn in range(rng.randint(2, 5)):
        if turn:
            tool = span(50, 400)
            ids += [rng.randrange(vocab) for _ in range(tool)]
            mask += [0] * tool
        reply = span(60, 160)
        ids += [rng.randrange(vocab) for _ in range(reply)]
        mask += [1] * reply
    return ids, mask


def oracle_like_samples(n_tokens: int, vocab: int, seed: int, scale: float = 1.0) -> list[Any]:
    """Samples of about ``n_tokens`` in all, shaped like oracle SFT transcripts (module docstring);
    ``scale`` shrinks every span (a tiny model's short context)."""
    from opencomposer.train.samples import Sample

    rng = random.Random(seed)
    span, system = _spans(rng, scale), _system(vocab, scale)
    samples, total = [], 0
    while True:
        prompt = system + [rng.randrange(vocab) for _ in range(span(40, 200))]  # a different task each
        turns, mask = _turns(rng, span, vocab)
        ids = prompt + turns
        if total + len(ids) > n_tokens and samples:
            return samples
        samples.append(Sample(input_ids=ids, loss_mask=[0] * len(prompt) + mask, old_logprobs=[0.0] * len(ids)))
        total += len(ids)


def rl_like_samples(n_tokens: int, vocab: int, seed: int, scale: float = 1.0, k: int = 8) -> list[Any]:
    """GRPO groups of ``k`` rollouts, about ``n_tokens`` in all (at least one group): a group's
    rollouts share their first prompt (the system prompt and one task), then each takes its own
    turns; sampler logprobs, and advantages of either sign, as an RL step trains them."""
    from opencomposer.train.samples import Sample

    rng = random.Random(seed)
    span, system = _spans(rng, scale), _system(vocab, scale)
    samples: list[Any] = []
    while True:
        prompt = system + [rng.randrange(vocab) for _ in range(span(40, 200))]
        group = []
        for i in range(k):
            turns, mask = _turns(rng, span, vocab)
            ids = prompt + turns
            group.append(Sample(input_ids=ids, loss_mask=[0] * len(prompt) + mask, old_logprobs=[-1.0] * len(ids),
                                advantage=1.0 if i % 2 else -1.0))
        if samples and sum(len(s.input_ids) for s in samples + group) > n_tokens:
            return samples
        samples += group


def dense_samples(n_tokens: int, vocab: int, seed: int, seq_len: int) -> list[Any]:
    """Full windows of ``seq_len`` random tokens, a loss on every token but the first (pretraining's
    and dense SFT's shape), ``n_tokens // seq_len`` of them (at least one)."""
    from opencomposer.train.samples import Sample

    rng = random.Random(seed)
    return [Sample(input_ids=[rng.randrange(vocab) for _ in range(seq_len)], loss_mask=[0] + [1] * (seq_len - 1),
                   old_logprobs=[0.0] * seq_len) for _ in range(max(1, n_tokens // seq_len))]


BATCHES = ("oracle", "rl", "dense")


def make_batch(kind: str, tokens: int, vocab: int, seed: int, context: int) -> list[Any]:
    """One step's samples of ``kind`` (``BATCHES``) for a model of ``context`` positions."""
    scale = min(1.0, context / 3200)
    if kind == "oracle":
        return oracle_like_samples(tokens, vocab, seed, scale)
    if kind == "rl":
        return rl_like_samples(tokens, vocab, seed, scale)
    return dense_samples(tokens, vocab, seed, min(tokens, context))


def load_for_bench(model_name: str, device: str) -> tuple[Any, Any]:
    """``load_model(model_name)``, or ``shape:NAME``: a randomly initialised model of a real shape
    (``bench.toolkit.SHAPES``, ``bench.fsdp``'s 7B) with a stand-in tokenizer (pad id 0)."""
    from types import SimpleNamespace

    import torch

    if model_name.startswith("shape:"):
        from opencomposer.bench.fsdp import EXTRA_SHAPES
        from opencomposer.bench.toolkit import SHAPES, random_model

        SHAPES.update(EXTRA_SHAPES)
        return random_model(model_name.removeprefix("shape:"), device, torch.float32), SimpleNamespace(pad_token_id=0)
    from opencomposer.models import load_model

    return load_model(model_name, device=device)


def run_arm(arm: str, model_name: str, tokens: int, steps: int, warmup: int, lr: float, seed: int,
            device: str = "cpu", batches: str = "oracle") -> dict[str, Any]:
    """One arm in this process: build the trainer (or, arm ``hf``, a plain HF model and AdamW),
    train ``warmup + steps`` steps on ``batches`` (SFT steps; ``rl``: RL steps)."""
    import torch

    from opencomposer.train.config import TrainConfig
    from opencomposer.train.loss import LossConfig
    from opencomposer.train.trainer import Trainer

    settings = ARMS["baseline" if arm == "hf" else arm]
    if settings.get("fp8", "off") != "off":
        from opencomposer.train.fp8 import fp8_unsupported

        why = fp8_unsupported(device)
        if why:
            return {"arm": arm, "skipped": why}
    torch.manual_seed(seed)
    model, tok = load_for_bench(model_name, device)
    cuda = device.startswith("cuda")
    loaded_rss = _rss_mb()
    context, vocab = int(model.config.max_position_embeddings), model.config.vocab_size
    cfg = TrainConfig(lr=lr, micro_batch_tokens=tokens, **settings)
    trainer = Trainer(model, tok, cfg, name=model_name)  # arm hf: for its collate and the FLOP count only
    step_fn = PlainHF(model, lr, trainer.bf16, tok, tokens).step if arm == "hf" else \
        (lambda b: trainer.rl_step(b, LossConfig(), float(sum(len(s.input_ids) for s in b)))) if batches == "rl" \
        else trainer.sft_step
    losses, seconds, n_tokens, passes, timed = [], [], 0.0, 0, []
    for step in range(warmup + steps):
        batch = make_batch(batches, tokens, vocab, seed + step, context)
        t0 = time.perf_counter()
        m = step_fn(batch)
        if cuda:
            torch.cuda.synchronize()  # the step's kernels done, not only queued
        losses.append(round(m["loss"], 6))
        if step >= warmup:
            seconds.append(time.perf_counter() - t0)
            n_tokens += sum(len(s.input_ids) for s in batch)
            passes += len(trainer._micro_batches(batch))
            timed.append(batch)
    total = sum(seconds)
    work = step_work(trainer, model, timed)
    return {"arm": arm, "settings": ARMS.get(arm, {"plain_hf": True}), "tokens_per_second": round(n_tokens / total, 1) if total else 0.0,
            **work, "achieved_gflops": round(work["model_gflop"] / total, 2) if total else 0.0,
            "step_seconds": [round(s, 2) for s in seconds], "timed_tokens": int(n_tokens), "forward_passes": passes,
            "losses": losses, "peak_rss_mb": _rss_mb(), "rss_after_load_mb": loaded_rss,
            "threads": torch.get_num_threads(), "device": torch.cuda.get_device_name() if cuda else "cpu",
            "bf16": trainer.bf16, **({"fp8": trainer.fp8.as_dict()} if trainer.fp8 else {}),
            **({"peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1)} if cuda else {})}


class PlainHF:
    """The baseline the trainer is measured against: the model's own forward with ``labels``
    (cross-entropy on the loss tokens, rows right-padded), ``backward``, ``torch.optim.AdamW``;
    bf16 autocast where the trainer would use it. No packing, chunking or checkpointing. A step's
    samples go in micro-batches of at most ``tokens`` padded positions (one sample at least), as
    the trainer's, the gradients summed, the loss the mean over the step's loss tokens."""

    def __init__(self, model: Any, lr: float, bf16: bool, tok: Any, tokens: int):
        import torch

        self.model, self.bf16, self.tokens = model.train(), bf16, tokens
        self.pad = getattr(tok, "pad_token_id", None) or 0
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

    def micro_batches(self, batch: list[Any]) -> list[list[Any]]:
        out: list[list[Any]] = []
        for s in batch:
            rows = out[-1] + [s] if out else [s]
            if out and len(rows) * max(len(r.input_ids) for r in rows) <= self.tokens:
                out[-1] = rows
            else:
                out.append([s])
        return out

    def step(self, batch: list[Any]) -> dict[str, float]:
        import torch

        device = next(self.model.parameters()).device
        total = sum(sum(s.loss_mask[1:]) for s in batch) or 1  # targets with a token before them
        summed = 0.0
        for mb in self.micro_batches(batch):
            width = max(len(s.input_ids) for s in mb)
            ids = torch.full((len(mb), width), self.pad, dtype=torch.long)
            labels = torch.full((len(mb), width), -100, dtype=torch.long)
            attn = torch.zeros((len(mb), width), dtype=torch.long)
            for i, s in enumerate(mb):
                n = len(s.input_ids)
                ids[i, :n] = torch.tensor(s.input_ids)
                attn[i, :n] = 1
                labels[i, :n] = torch.where(torch.tensor(s.loss_mask, dtype=torch.bool), ids[i, :n], -100)
            count = int((labels[:, 1:] != -100).sum())
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16):
                loss = self.model(input_ids=ids.to(device), attention_mask=attn.to(device),
                                  labels=labels.to(device), use_cache=False).loss
            (loss * (count / total)).backward()  # HF's mean over this micro-batch, weighted to the step's
            summed += loss.item() * count
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"loss": summed / total}


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
        log: Callable[[str], None] = print, device: str = "cpu", batches: str = "oracle") -> dict[str, Any]:
    """Every arm in its own process; returns the figures and each arm's speed-up over the first."""
    unknown = sorted(set(arms) - set(ARMS) - {"hf"})
    if unknown:
        raise ValueError(f"--arms: unknown arm(s) {', '.join(unknown)}; expected some of hf,{','.join(ARMS)}")
    if batches not in BATCHES:
        raise ValueError(f"--batches {batches!r}: expected one of {', '.join(BATCHES)}")
    results, skipped = [], {}
    for arm in arms:
        log(f"bench train: {arm} ({ARMS.get(arm, 'plain HF forward + backward + AdamW')}), {batches} batches ...")
        cmd = [sys.executable, "-m", "opencomposer.bench.train", arm, model_name, str(tokens), str(steps),
               str(warmup), str(lr), str(seed), device, batches]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            why = " (killed by SIGKILL: out of memory?)" if out.returncode == -9 else ""
            raise RuntimeError(f"bench train arm {arm} failed, exit {out.returncode}{why}:\n{out.stderr[-3000:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        if "skipped" in res:
            log(f"  skipped: {res['skipped']}")
            skipped[arm] = res["skipped"]
            continue
        gpu = f", peak GPU {res['peak_gpu_mb']} MB" if "peak_gpu_mb" in res else ""
        log(f"  {res['tokens_per_second']} tokens/s ({res['achieved_gflops']} model GFLOP/s), peak RSS "
            f"{res['peak_rss_mb']} MB{gpu}, losses {res['losses']}")
        results.append(res)
    if not results:
        raise ValueError(f"bench train: every arm was skipped ({'; '.join(f'{a}: {w}' for a, w in skipped.items())})")
    first = results[0]
    peak = gemm_peak_gflops(device)  # after the arms: the machine as they found it, in this run
    per_token = first["model_flop_per_token"]
    datasheet = _datasheet_peak_gflops(first["device"])
    for r in results:
        r["speedup"] = round(r["tokens_per_second"] / first["tokens_per_second"], 2) if first["tokens_per_second"] else None
        # an RL step's loss is not the plain baseline's cross-entropy: compared between trainer arms only
        same_loss = batches != "rl" or (r["arm"] == "hf") == (first["arm"] == "hf")
        r["max_loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"], first["losses"])) if same_loss else None
        r["mfu_of_gemm_peak"] = round(r["achieved_gflops"] / peak, 3) if peak else None
        r["mfu"] = round(r["achieved_gflops"] / datasheet, 3) if datasheet else None  # GPUs: the dense bf16 peak
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
    return {"bench": "train", "model": model_name, "device": device, "batches": batches, "micro_batch_tokens": tokens,
            "steps": steps, "warmup": warmup, "lr": lr, "arms": results, "skipped_arms": skipped, "ceiling": ceiling,
            "datasheet_peak_gflops": datasheet, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _datasheet_peak_gflops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak (``bench.fsdp.PEAK_BF16``), for MFU; None on a CPU or an unlisted GPU."""
    from opencomposer.bench.fsdp import PEAK_BF16

    return next((v / 1e9 for k, v in PEAK_BF16.items() if k in device_name), None)


def _rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux


if __name__ == "__main__":  # one arm, in the fresh process ``run`` starts
    arm, name, tokens, steps, warmup, lr, seed, device, batches = sys.argv[1:10]
    print(json.dumps(run_arm(arm, name, int(tokens), int(steps), int(warmup), float(lr), int(seed), device, batches)))
