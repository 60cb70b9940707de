"""Supervised fine-tuning on agent transcripts (e.g. the oracle's), the stage before RL.

    result = run_sft(sorted(Path("runs/oracle").glob("*.json")), "smollm2-135m",
                     Path("runs/sft"), TrainConfig(lr=1e-4, lora=True), epochs=2)
    load_model("runs/sft/model")        # the exported, merged model

Every assistant turn of every transcript becomes loss tokens through ``rl.samples.sft_samples``:
the prompt is rendered by the same ``render_prompt`` the deployed agent uses, and the
turn is the chat template's own rendering of it, end-of-turn token included. Text is
re-tokenised rather than taking recorded token ids, so transcripts from any policy (the
oracle, an API model, another tokenizer) train any model. Sequences longer than the
model's context are dropped and counted. Writes ``<out_dir>/checkpoints`` (resumable
trainer state) and ``<out_dir>/model`` (plain HF directory).

Under torchrun every rank runs this function: the model is sharded (FSDP2), each step's
batch is the same on every rank and split over them (``train/distributed.py``), rank 0
shows progress and writes; the result is the same everywhere.

    torchrun --nproc-per-node 4 -m opencomposer.cli sft runs/oracle --model M --out runs/sft

Test: ``pytest tests/unit/train/test_sft.py``.
"""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from opencomposer.harness.prompt import episode_tools
from opencomposer.harness.trajectory import Trajectory
from opencomposer.models import load_model
from opencomposer.train.samples import Sample, sft_samples
from opencomposer.train.checkpoint import save_checkpoint
from opencomposer.train.export import export_model
from opencomposer.train.config import TrainConfig
from opencomposer.train.distributed import init_from_env, rank_device, shows_progress
from opencomposer.train.trainer import Trainer


def load_transcripts(transcripts: Sequence[str | Path | Trajectory]) -> list[Trajectory]:
    """Trajectories from paths (JSON transcripts) or already loaded ones."""
    return [t if isinstance(t, Trajectory) else Trajectory.load(t) for t in transcripts]


def build_sft_samples(
    trajectories: list[Trajectory], tokenizer: Any, max_tokens: int
) -> tuple[list[Sample], int]:
    """All SFT samples of ``trajectories`` that fit ``max_tokens``, and how many did not."""
    samples, dropped = [], 0
    for traj in trajectories:
        for s in sft_samples(traj, tokenizer, episode_tools(traj)):  # the tools the episode was given
            if len(s) > max_tokens:
                dropped += 1
            else:
                samples.append(s)
    return samples, dropped


def run_sft(
    transcripts: Sequence[str | Path | Trajectory],
    model_name: str,
    out_dir: str | Path,
    cfg: TrainConfig | None = None,
    epochs: int = 1,
    batch_size: int = 8,
    device: str | None = None,
    save: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Train ``model_name`` on ``transcripts``; returns losses, throughput and output paths.

    ``batch_size`` is sequences per optimizer step (micro-batched by
    ``cfg.micro_batch_tokens``); each epoch visits them in a new order drawn from ``cfg.seed``.
    """
    cfg = cfg or TrainConfig()
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"need epochs >= 1 and batch_size >= 1, got {epochs}, {batch_size}")
    out_dir = Path(out_dir)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dist = init_from_env(device)  # a plain process unless started by torchrun
    device = str(rank_device(dist, device))
    trajectories = load_transcripts(transcripts)
    model, tokenizer = load_model(model_name, device=device)
    max_tokens = int(model.config.max_position_embeddings)
    samples, dropped = build_sft_samples(trajectories, tokenizer, max_tokens)
    if not samples:
        raise ValueError(
            f"no trainable assistant turns in {len(trajectories)} transcripts "
            f"({dropped} sequences longer than the {max_tokens}-token context)"
        )
    trainer = Trainer(model, tokenizer, cfg, name=model_name, dist=dist)
    rng = random.Random(cfg.seed)
    batches_per_epoch = -(-len(samples) // batch_size)
    losses: list[float] = []
    tokens, t0 = 0.0, time.perf_counter()
    with progress_bar(shows_progress(dist, progress)) as bar:
        task = bar.add_task("sft", total=epochs * batches_per_epoch, loss=float("nan")) if bar else None
        for _ in range(epochs):
            order = samples[:]
            rng.shuffle(order)
            for i in range(0, len(order), batch_size):
                metrics = trainer.sft_step(order[i : i + batch_size])
                losses.append(metrics["loss"])
                tokens += metrics["tokens"]
                if bar:
                    bar.update(task, advance=1, loss=metrics["loss"])
    seconds = time.perf_counter() - t0
    result: dict[str, Any] = {
        "model": model_name, "transcripts": len(trajectories), "samples": len(samples),
        "dropped_too_long": dropped, "steps": len(losses), "first_loss": losses[0],
        "last_loss": losses[-1], "losses": losses, "tokens": int(tokens), "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 else 0.0, "world_size": dist.world,
    }
    if save:
        result["checkpoint"] = str(save_checkpoint(out_dir / "checkpoints", trainer, dict(result), len(losses)))
        result["export"] = str(export_model(out_dir / "model", trainer))
    return result


def progress_bar(enabled: bool) -> Any:
    """A rich progress bar showing the last loss, or a null context when disabled."""
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"), TimeRemainingColumn(),
    )
