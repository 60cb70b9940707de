"""The SFT warm start: oracle traces of training tasks, then supervised epochs on them; both
resumable, so a machine that is lent for minutes at a time finishes them over several calls.

    trajs = oracle_traces(tasks, backend, out / "traces", cfg, workers=8, stop=clock.past)
    result = sft_warm_start(trainer, trajs, cfg, log, ckpt_dir=out / "sft_ckpt", stop=clock.past)

``oracle_traces`` keeps each task's transcript and, after it, a verdict file: a later call
reads both back instead of running the oracle again. ``sft_warm_start`` shuffles each epoch
with its own seed (``[run] seed`` and the epoch), so where it stands is (epoch, batch); with a
``ckpt_dir`` it checkpoints the trainer (weights, optimizer, RNG) at each epoch's end and
whenever ``stop()`` says so, and a later call with the same samples and settings goes on from
there: the same weights as a run never stopped (tested). ``stop()`` is asked between units of
work (one oracle episode, one SFT step); when it returns True the function saves what it has
and raises ``Interrupted``.

Test: ``pytest tests/integration/test_warm_start.py``.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from opencomposer.config import AgentConfig
from opencomposer.episode.progress import duration
from opencomposer.episode.run import run_task
from opencomposer.harness.prompt import episode_tools
from opencomposer.harness.trajectory import Trajectory
from opencomposer.paths import atomic_write_text
from opencomposer.policies import make_policy
from opencomposer.rl.config import RLRunConfig
from opencomposer.tasks.format import Task
from opencomposer.train.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
from opencomposer.train.checkpoint_files import CheckpointError, read_json
from opencomposer.train.samples import sft_samples

SFT_BATCH = 4  # samples an SFT step
# what a resumed SFT must share with its checkpoint, and the setting that decides each
_PLAN_SETTING = {"samples": "the traces", "tokens": "the traces", "epochs": "[sft] epochs", "lr": "[sft] lr",
                 "batch": "the SFT batch", "seed": "[run] seed"}
_VERDICT = ".verdict"


class Interrupted(Exception):
    """A stage stopped because ``stop()`` said so, its progress saved: call it again to go on."""


def oracle_traces(tasks: list[Path], backend: str, out: Path, cfg: RLRunConfig, workers: int = 1,
                  stop: Callable[[], bool] | None = None) -> list[Trajectory]:
    """Oracle episodes on training tasks, saved as transcripts (the SFT data), ``workers`` at a time.

    The compact oracle batches independent calls into one turn, so its traces fit the short
    turn budgets small models get; traces that do not solve the task are dropped. The traces
    come back in the order of ``tasks`` whatever ``workers`` is. A task whose transcript and
    verdict (``<out>/<id>.verdict``, written after the transcript, with the ``[agent]`` settings
    and the oracle, direct or grounded, it was made under) exist is read back, not run, if those are
    this call's. A setting the verdict does not record did not exist when it was written: it counts
    as that setting's default (a new setting's default keeps the behaviour from before it).
    """
    out.mkdir(parents=True, exist_ok=True)
    skipped = []
    agent = cfg.agent.model_dump(mode="json")  # a trace made under other [agent] settings is made again
    defaults = AgentConfig().model_dump(mode="json")
    oracle = "grounded" if cfg.sft.grounded_oracle else "direct"  # so is one of the other oracle

    def one(p: Path) -> Trajectory | None:
        task = Task.load(p)
        transcript, verdict = out / f"{task.id}.json", out / f"{task.id}{_VERDICT}"
        if verdict.is_file() and transcript.is_file():
            kept = json.loads(verdict.read_text())
            if {**defaults, **kept.get("agent", {})} == agent and kept.get("oracle", "direct") == oracle:
                return Trajectory.load(transcript) if kept.get("passed") is True else None
        if stop is not None and stop():
            skipped.append(task.id)
            return None
        res = run_task(task, make_policy("oracle", task=task, compact=True, grounded=cfg.sft.grounded_oracle),
                       backend, cfg.agent, transcript=transcript)
        atomic_write_text(verdict, json.dumps({"passed": bool(res.reward.passed), "agent": agent, "oracle": oracle}))
        return res.trajectory if res.reward.passed else None  # only traces that solved the task teach the format

    if workers <= 1:
        done = [one(p) for p in tasks]
    else:
        with ThreadPoolExecutor(workers) as ex:
            done = list(ex.map(one, tasks))
    if skipped:
        raise Interrupted(f"oracle traces: {len(tasks) - len(skipped)} of {len(tasks)} done, kept in {out}")
    return [t for t in done if t is not None]


def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(f"{seed}:sft:{epoch}").shuffle(order)
    return order


def sft_warm_start(trainer: Any, trajs: list[Trajectory], cfg: RLRunConfig, log: Callable[[str], None],
                   ckpt_dir: Path | None = None, stop: Callable[[], bool] | None = None) -> dict:
    """``[sft] epochs`` over the traces' samples (assistant tokens only) at ``[sft] lr``, then a
    fresh optimizer at ``[train] lr`` for RL. See the module docstring for ``ckpt_dir`` and ``stop``."""
    samples = [s for t in trajs for s in sft_samples(t, trainer.tokenizer, episode_tools(t))]  # every rank renders them
    if not samples:
        raise RuntimeError(
            f"SFT: none of the oracle traces solved its task within agent.max_turns="
            f"{cfg.agent.max_turns} (the compact oracle needs 4 turns for a one-hunk task)")
    plan = {"samples": len(samples), "tokens": sum(len(s.input_ids) for s in samples), "epochs": cfg.sft.epochs,
            "lr": cfg.sft.lr, "batch": SFT_BATCH, "seed": cfg.run.seed}
    epoch, start, losses, done_tokens, before = 0, 0, [], 0, 0.0
    resumed = ckpt_dir is not None and _has_checkpoint(ckpt_dir)
    if resumed:
        saved = read_json(resolve_checkpoint(ckpt_dir) / "state.json").get("sft_plan", {})
        for key, value in plan.items():  # before any weight is loaded
            if saved.get(key) != value:
                raise CheckpointError(
                    f"{ckpt_dir}: an SFT checkpoint of another plan ({key} {saved.get(key)!r} there, {value!r} now: "
                    f"{_PLAN_SETTING[key]} changed); delete {ckpt_dir} to start SFT over")
        state = load_checkpoint(ckpt_dir, trainer)
        epoch, start = int(state["sft_epoch"]), int(state["sft_next"])
        losses, done_tokens, before = list(state["sft_losses"]), int(state["sft_tokens"]), float(state["sft_seconds"])
        log(f"  SFT: resuming at epoch {epoch + 1}, step {len(losses)} (checkpoint {resolve_checkpoint(ckpt_dir).name})")
    else:
        trainer.set_lr(cfg.sft.lr)
    total = -(-len(samples) // SFT_BATCH) * cfg.sft.epochs
    t0 = time.perf_counter()
    said = t0

    saved_at = [len(losses) if resumed else -1]

    def save(next_epoch: int, next_start: int) -> None:
        if ckpt_dir is None or saved_at[0] == len(losses):  # nothing done since the last checkpoint
            return
        saved_at[0] = len(losses)
        state = {"sft_plan": plan, "sft_epoch": next_epoch, "sft_next": next_start, "sft_losses": losses,
                 "sft_tokens": done_tokens, "sft_seconds": before + time.perf_counter() - t0}
        save_checkpoint(ckpt_dir, trainer, state, len(losses), keep=1)

    while epoch < cfg.sft.epochs:
        order = _epoch_order(len(samples), cfg.run.seed, epoch)
        for i in range(start, len(samples), SFT_BATCH):
            if stop is not None and stop():
                save(epoch, i)
                raise Interrupted(f"SFT: stopped at epoch {epoch + 1}, step {len(losses)} of {total}"
                                  + (f"; checkpoint in {ckpt_dir}" if ckpt_dir else " (no checkpoint kept)"))
            m = trainer.sft_step([samples[j] for j in order[i:i + SFT_BATCH]])
            losses.append(m["loss"])
            done_tokens += m["tokens"]
            now = time.perf_counter()
            if now - said >= 20 and len(losses) < total:  # never silent for minutes on a slow machine
                said = now
                spent = before + now - t0
                log(f"  SFT step {len(losses)}/{total}: loss {losses[-1]:.3f}, {done_tokens / spent:.0f} tok/s, "
                    f"elapsed {duration(spent)}, eta {duration(spent * (total - len(losses)) / len(losses))}")
        log(f"  SFT epoch {epoch + 1}/{cfg.sft.epochs}: loss {losses[-1]:.3f}")
        epoch, start = epoch + 1, 0
        if epoch < cfg.sft.epochs:
            save(epoch, 0)
    # RL starts with a fresh optimizer at its own learning rate
    trainer.optimizer.state.clear()
    trainer.set_lr(cfg.train.lr)
    secs = before + time.perf_counter() - t0
    tokens = plan["tokens"] * cfg.sft.epochs
    return {"traces": len(trajs), "samples": len(samples), "steps": len(losses), "loss_first": losses[0],
            "loss_last": losses[-1], "seconds": round(secs, 1), "tokens_per_second": round(tokens / max(secs, 1e-9), 1)}


def _has_checkpoint(ckpt_dir: Path) -> bool:
    try:
        resolve_checkpoint(ckpt_dir)
        return True
    except CheckpointError:
        return False
