"""Continued pretraining (CPT): next-token cross-entropy on raw code, Composer's first stage.

    result = run_pretrain(["src/", "more.jsonl:2"], "smollm2-135m", "runs/cpt", steps=100, seq_len=256,
                          batch_size=8, eval_data=["other-codebase/"])
    load_model("runs/cpt/model")

    opencomposer pretrain src/ more.jsonl:2 --model smollm2-135m --out runs/cpt --steps 100

Data (``train/corpus.py``): documents split into training and held-out by document, each
side packed into ``seq_len`` windows (documents joined by the end-of-text token, no
padding). Every token of a window but the first is a loss token, and every step divides
by the same constant, the global batch's loss tokens (``batch_size * (seq_len - 1)``), so
splitting the batch ``batch_for_step(step)`` across ranks does not change the update. The
loss is the ``Trainer``'s SFT loss (``Trainer.sft_backward``) on full loss masks.

Schedule: linear warm-up to ``lr`` over ``warmup`` steps, then a cosine to
``lr * min_lr_ratio`` at ``steps``. Held-out loss and perplexity are measured before the
first step, every ``eval_every`` steps and at the end, on up to ``eval_windows`` held-out
windows of the training mix (per source too) and of every ``eval_data`` codebase.

Writes ``<out>/checkpoints`` (``save_checkpoint``, every ``save_every`` steps; a run
resumes from it at the exact step, the batch of step ``s`` being a function of the seed
and ``s`` only), ``<out>/model`` (``export_model``) and ``<out>/result.json``.

Under torchrun every rank runs this function: the model is sharded (FSDP2,
``train/distributed.py``), each rank trains its share of the global batch of every step, and
the update is the one a single process makes; rank 0 shows progress and writes the files.

    torchrun --nproc-per-node 8 -m opencomposer.cli pretrain data/ --model M --out runs/cpt

Test: ``pytest tests/unit/train/test_pretrain.py``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from opencomposer.models import load_model
from opencomposer.paths import atomic_write_text
from opencomposer.train.samples import Sample
from opencomposer.train.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
from opencomposer.train.checkpoint_files import CheckpointError
from opencomposer.train.export import export_model
from opencomposer.train.long_context import extend_context
from opencomposer.train.config import PretrainRunConfig, TrainConfig
from opencomposer.train.corpus import Mix, PackedSource, cut, pack, pack_corpus, parse_source, read_documents
from opencomposer.train import distributed
from opencomposer.train.distributed import init_from_env, rank_device
from opencomposer.train.sft import progress_bar
from opencomposer.train.trainer import Trainer

WHAT = "pretrain data"
# What fixes the order of the batches: a checkpoint made with other values cannot be continued as if never stopped.
RESUME_KEYS = ("model", "seq_len", "batch_size", "seed", "held_out", "corpus", "context_factor")
SAVED_BEFORE = {"context_factor": 1.0}  # what a checkpoint written before a key existed meant by it


def lr_at(step: int, lr: float, steps: int, warmup: int, min_lr_ratio: float) -> float:
    """Learning rate of step ``step`` (0-based): linear warm-up to ``lr`` at step ``warmup - 1``, then
    a cosine reaching ``lr * min_lr_ratio`` at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step + 1 - warmup) / max(steps - warmup, 1)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def window_samples(windows: Sequence[Sequence[int]]) -> list[Sample]:
    """Windows as trainer samples: every token but the first (it has no context) is a loss token."""
    return [Sample(list(w), [0] + [1] * (len(w) - 1), [0.0] * len(w)) for w in windows]


def loss_normalizer(batch_size: int, seq_len: int) -> int:
    """The global batch's loss tokens: every rank's share of a step divides by this one constant."""
    return batch_size * (seq_len - 1)


@torch.no_grad()
def window_losses(trainer: Trainer, windows: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """Summed next-token NLL of each window ``[n, seq_len]`` under the trainer's model, in its precision."""
    out = []
    model, dev = trainer.model, trainer.device
    for i in range(0, len(windows), batch):
        ids = windows[i:i + batch].to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=trainer.bf16):
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        nll = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        out.append(nll.view(len(ids), -1).sum(1).cpu())
    return torch.cat(out)


class EvalSet:
    """Held-out windows (each tagged with its source) measured as one loss and per source."""

    def __init__(self, name: str, parts: dict[str, torch.Tensor], limit: int, seed: int):
        rows = [(src, w) for src, ws in parts.items() for w in ws]
        pick = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:limit].sort().values
        self.name = name
        self.sources = [rows[i][0] for i in pick]
        self.windows = torch.stack([rows[i][1] for i in pick]) if len(pick) else torch.zeros(0, 2, dtype=torch.long)

    def measure(self, trainer: Trainer) -> dict[str, Any]:
        sums = window_losses(trainer, self.windows)
        per_window = self.windows.shape[1] - 1
        loss = float(sums.sum()) / (len(sums) * per_window)
        res: dict[str, Any] = {"loss": round(loss, 5), "perplexity": round(math.exp(loss), 3),
                               "windows": len(sums), "tokens": len(sums) * per_window}
        names = sorted(set(self.sources))
        if len(names) > 1:
            res["sources"] = {n: round(float(sum(s for s, m in zip(sums, self.sources) if m == n))
                                       / (self.sources.count(n) * per_window), 5) for n in names}
        return res


def eval_sets(corpus: list[PackedSource], eval_data: Sequence[str | Path], tokenizer: Any, seq_len: int,
              limit: int, seed: int, lengths: Sequence[int] = ()) -> list[EvalSet]:
    """The held-out windows of the training mix, then one set per ``eval_data`` codebase (all of it
    held out), then ``held_out@N`` for each length N of ``lengths``: the mix's held-out stream cut
    into windows of N tokens (a long context measured on the same documents)."""
    sets = [EvalSet("held_out", {p.source.name: p.held_out for p in corpus if len(p.held_out)}, limit, seed)]
    for n in lengths:
        if n == seq_len:
            continue  # that is "held_out"
        parts = {p.source.name: cut(p.held_out.reshape(-1), n) for p in corpus if len(p.held_out)}
        parts = {k: v for k, v in parts.items() if len(v)}
        if not parts:
            have = sum(p.held_out.numel() for p in corpus)
            raise ValueError(f"eval_lengths: {n}: the held-out documents hold {have} tokens, not one window of {n}; "
                             "give more data, a larger held_out share, or a shorter length")
        sets.append(EvalSet(f"held_out@{n}", parts, limit, seed))
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    for path in eval_data:
        docs = read_documents([parse_source(path, "eval data")], tokenizer, "eval data")
        wins = cut(pack([d.ids for d in docs], sep), seq_len)
        if not len(wins):
            raise ValueError(f"eval data {path}: {len(docs)} documents ({sum(len(d.ids) for d in docs)} tokens) "
                             f"make 0 windows of seq_len={seq_len}")
        sets.append(EvalSet(str(path), {str(path): wins}, limit, seed))
    return sets


def run_pretrain(data: Sequence[str | Path], model_name: str, out_dir: str | Path, *, steps: int = 100,
                 seq_len: int = 256, batch_size: int = 8, lr: float = 1e-4, warmup: int = 10,
                 min_lr_ratio: float = 0.1, eval_every: int = 25, eval_windows: int = 32, save_every: int = 50,
                 held_out: float = 0.05, eval_data: Sequence[str | Path] = (), seed: int = 0,
                 cfg: TrainConfig | None = None, device: str | None = None,
                 progress: bool = True, context_factor: float = 1.0,
                 eval_lengths: Sequence[int] = ()) -> dict[str, Any]:
    """Continue pretraining ``model_name`` on ``data`` (see the module docstring); returns the result.

    ``cfg`` gives the optimiser (betas, weight decay, clipping), precision, LoRA and micro-batching;
    its ``lr`` and ``warmup_steps`` are replaced by this schedule's. ``context_factor > 1``: the
    context extended first (``train/long_context.py``); the evaluation before the first step is
    then made twice, with the native RoPE (``native_rope``) and the extended one.
    ``eval_lengths``: held-out loss on windows of these lengths too."""
    if steps < 1 or batch_size < 1 or seq_len < 2 or warmup < 0 or not 0 <= min_lr_ratio <= 1 or lr <= 0:
        raise ValueError(f"need steps >= 1, batch_size >= 1, seq_len >= 2, warmup >= 0, lr > 0 and 0 <= "
                         f"min_lr_ratio <= 1; got steps={steps}, batch_size={batch_size}, seq_len={seq_len}, "
                         f"warmup={warmup}, lr={lr}, min_lr_ratio={min_lr_ratio}")
    if not 0 < held_out < 1:
        raise ValueError(f"held_out={held_out}: the share of documents held out must be above 0 and below 1")
    if not data:
        raise ValueError(f"{WHAT}: none given (source files, directories, .jsonl files; path or path:weight)")
    out = Path(out_dir)
    sources = [parse_source(d, WHAT) for d in data]
    for s in sources:  # before the model loads: a typo should not cost a minute
        if not s.path.exists():
            raise FileNotFoundError(f"{WHAT}: {s.path} does not exist")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dist = init_from_env(device)  # under torchrun: sharded, each rank trains its share of the global batch
    device = str(rank_device(dist, device))
    model, tok = load_model(model_name, device=device)
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    longest = max([seq_len, *eval_lengths])
    if context and longest > context * context_factor:
        extended = f" x context_factor {context_factor:g} = {int(context * context_factor)}" if context_factor > 1 else ""
        raise ValueError(f"{'seq_len' if seq_len == longest else 'eval_lengths'}={longest} is longer than "
                         f"{model_name}'s context ({context} tokens, max_position_embeddings{extended})")
    corpus = pack_corpus(sources, tok, seq_len, held_out, seed, WHAT)
    mix = Mix([p.train for p in corpus], [p.source.weight for p in corpus], batch_size, seed)
    sets = eval_sets(corpus, eval_data, tok, seq_len, eval_windows, seed, eval_lengths)
    counts = {p.source.name: {**p.counts(), "share": round(share, 4)} for p, share in zip(corpus, mix.shares())}
    setup = {"model": model_name, "seq_len": seq_len, "batch_size": batch_size, "seed": seed, "held_out": held_out,
             "corpus": counts, "context_factor": context_factor}
    cfg = (cfg or TrainConfig()).model_copy(update={"lr": lr, "warmup_steps": 0})
    trainer = Trainer(model, tok, cfg, name=model_name, dist=dist)
    state = _resume(out / "checkpoints", trainer, setup)
    start, history, evals = int(state.get("step", 0)), state.get("history", []), state.get("evals", [])
    if start > steps:
        raise ValueError(f"{out / 'checkpoints'}: the checkpoint is at step {start}, past steps={steps}; "
                         "ask for more steps or use another --out")
    if context_factor > 1 and not evals:  # the model as it came, before its RoPE is rescaled
        evals.append({**_evaluate(sets, trainer, 0), "native_rope": True})
    extension = extend_context(model, context_factor) if context_factor > 1 else None
    if len(evals) == (1 if extension else 0):
        evals.append(_evaluate(sets, trainer, 0))
    normalizer = loss_normalizer(batch_size, seq_len)
    train_s, t0 = 0.0, time.perf_counter()
    with progress_bar(distributed.shows_progress(dist, progress)) as bar:
        task = bar.add_task("pretrain", total=steps, completed=start, loss=float("nan")) if bar else None
        for step in range(start, steps):
            t = time.perf_counter()
            # the Trainer's own warm-up is off (cfg above): its base lr is this schedule's value for the step
            trainer.base_lr = lr_at(step, lr, steps, warmup, min_lr_ratio)
            metrics = trainer.sft_backward(window_samples(mix.batch_for_step(step)), normalizer)
            metrics.update(trainer.optimizer_step())
            train_s += time.perf_counter() - t
            history.append({"step": step + 1, "loss": round(metrics["loss"], 5), "lr": metrics["lr"],
                            "grad_norm": round(metrics["grad_norm"], 4), "skipped": bool(metrics["skipped"])})
            if bar:
                bar.update(task, advance=1, loss=metrics["loss"])
            done = step + 1
            if eval_every and done % eval_every == 0 and done < steps:
                evals.append(_evaluate(sets, trainer, done))
            if save_every and done % save_every == 0 and done < steps:
                save_checkpoint(out / "checkpoints", trainer, {**setup, "history": history, "evals": evals}, done)
    if evals[-1]["step"] != steps:
        evals.append(_evaluate(sets, trainer, steps))
    save_checkpoint(out / "checkpoints", trainer, {**setup, "history": history, "evals": evals}, steps)
    export_model(out / "model", trainer)
    tokens = (steps - start) * batch_size * seq_len
    result = {
        "model": model_name, "steps": steps, "resumed_from": start, "seq_len": seq_len, "batch_size": batch_size,
        "lr": lr, "warmup": warmup, "min_lr_ratio": min_lr_ratio,
        "params": sum(p.numel() for p in trainer.params),
        "train_windows": sum(len(p.train) for p in corpus), "held_out_windows": sum(len(p.held_out) for p in corpus),
        "corpus": counts, "tokens": tokens, "train_seconds": round(train_s, 2),
        "tokens_per_second": round(tokens / train_s, 1) if train_s > 0 else 0.0,
        "seconds": round(time.perf_counter() - t0, 2),
        "first_loss": history[0]["loss"] if history else None, "last_loss": history[-1]["loss"] if history else None,
        "before": evals[0], "after": evals[-1], "evals": evals,
        **({"context": {k: extension[k] for k in ("native_context", "context")}, "rope": extension["rope"]}
           if extension else {}),
        "model_dir": str(out / "model"), "checkpoint": str(out / "checkpoints"), "world_size": dist.world,
    }
    distributed.main_does(dist, lambda: atomic_write_text(out / "result.json",
                                                          json.dumps({**result, "history": history}, indent=1)))
    return result


def run_pretrain_config(cfg: PretrainRunConfig, *, device: str | None = None, progress: bool = True) -> dict[str, Any]:
    """``run_pretrain`` with the settings of a ``PretrainRunConfig`` (``configs/pretrain/pretrain.toml``; the
    ``[pretrain]`` stage of ``opencomposer train``, ``pipeline/run.py``)."""
    p = cfg.pretrain
    return run_pretrain(p.data, p.model, p.out_dir, steps=p.steps, seq_len=p.seq_len, batch_size=p.batch_size,
                        lr=p.lr, warmup=p.warmup_steps, min_lr_ratio=p.min_lr_ratio, eval_every=p.eval_every,
                        eval_windows=p.eval_windows, save_every=p.save_every, held_out=p.held_out,
                        eval_data=p.eval_data, seed=p.seed, cfg=cfg.train, device=device, progress=progress,
                        context_factor=p.context_factor, eval_lengths=p.eval_lengths)


def _evaluate(sets: list[EvalSet], trainer: Trainer, step: int) -> dict[str, Any]:
    return {"step": step, **{s.name: s.measure(trainer) for s in sets}}


def _resume(ckpt: Path, trainer: Trainer, setup: dict[str, Any]) -> dict[str, Any]:
    """The saved state of the newest checkpoint under ``ckpt`` (loaded into ``trainer``), or {} when
    there is none; a checkpoint of another model, window length, batch, seed or corpus is refused."""
    if not (ckpt / "latest").is_file():
        return {}
    path = resolve_checkpoint(ckpt)
    try:
        saved = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / 'state.json'}: unreadable: {e}") from None
    if "corpus" not in saved:
        raise CheckpointError(f"{path}: not a pretraining checkpoint (no corpus in state.json); use another --out")
    for key in RESUME_KEYS:
        if saved.get(key, SAVED_BEFORE.get(key)) != setup[key]:
            got, want = saved.get(key, SAVED_BEFORE.get(key)), setup[key]
            if key == "corpus":
                got, want = _corpus_diff(got, want)
            raise CheckpointError(f"{path / 'state.json'}: the checkpoint was made with {key}={got}, this run "
                                  f"has {key}={want}; resume with the same settings or use another --out")
    return load_checkpoint(path, trainer)


def _corpus_diff(saved: dict | None, now: dict) -> tuple[Any, Any]:
    """The first source whose counts differ, as (saved, now), so the error is readable."""
    saved = saved or {}
    for name in sorted(set(saved) | set(now)):
        if saved.get(name) != now.get(name):
            return {name: saved.get(name)}, {name: now.get(name)}
    return saved, now
