"""The learner of an RL run: one optimizer step on a batch of token samples, its weights for
the actor, its checkpoints.

    learner = Learner(cfg, out, start_model="tiny-random", dist=distributed.SINGLE, task_ids=[...])
    step, state = learner.resume()                  # (0, {}) on a fresh run; ConfigError: another run's
    metrics = learner.update(TrainBatch(samples, pairs=[], rollouts=8))
    weights = learner.weights()                     # Weights(version, state): what the actor publishes
    learner.save(step + 1, {"sampler": ...})        # when [run] save_every says so

The learner sees only what crosses the actor/learner boundary (``rl/run.py``): a
``TrainBatch`` in, ``Weights`` out. It owns the loss (``train/loss.py`` through
``Trainer.rl_backward``): the Composer GRPO variant with a constant normaliser (the most
tokens the batch's rollouts could hold, no per-sequence averaging), a KL term against the
policy RL starts from (``reference``), and the feedback distillation pairs.

Under torchrun every rank builds a learner and calls every method in step: the trainer is
sharded (FSDP2, ``train/distributed.py``), ``update`` trains this rank's share of the whole
batch, ``weights`` gathers the whole weights to rank 0 (a collective; the others get ``{}``)
and ``save`` writes one checkpoint for all of them.

Every checkpoint records the run's ``identity`` (``run_identity``: the model's name and the
fingerprint of the weights it starts from, the training pool's task ids, the seed, the loss and
LoRA settings), and ``resume`` refuses a checkpoint whose identity differs from the config's
(``checkpoint.check_identity``: a ``ConfigError`` naming the setting and both values); one from
before identities were recorded resumes with a warning (``resume_warning``). A pool that only grew
(``grown_from``: the pool the checkpoint was written with, every task of it still in the pool; new
tasks of single-epoch RL, none trained on) resumes, said in ``resume_note``; the next checkpoint
records the grown pool.

Test: ``pytest tests/unit/rl/test_learner.py tests/integration/test_rl_run.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opencomposer.config import ConfigError
from opencomposer.models.registry import load_model
from opencomposer.rl.config import RLRunConfig
from opencomposer.rl.staleness import staleness
from opencomposer.train import distributed
from opencomposer.train.checkpoint import (
    IDENTITY,
    check_identity,
    load_checkpoint,
    names_fingerprint,
    resolve_checkpoint,
    save_checkpoint,
    weights_fingerprint,
)
from opencomposer.train.loss import LossConfig
from opencomposer.train.samples import Sample
from opencomposer.train.trainer import Trainer, freeze, frozen_copy


@dataclass(frozen=True)
class TrainBatch:
    """What the actor hands the learner each step: token samples of whole GRPO groups."""

    samples: list[Sample]
    pairs: list[tuple[Sample, Sample]]  # feedback distillation: (student, teacher) of one completion
    rollouts: int  # the rollouts they came from: the loss divides by the most tokens these could hold


@dataclass(frozen=True)
class Weights:
    """What the learner hands the actor after each update: its weights at ``version``."""

    version: int
    state: dict[str, Any]  # whole, under HF names; sharded: rank 0's gather, {} on the other ranks
    # one process: the trainer's own (model, tokenizer), which 'hf' rollouts sample with (and
    # the engine starts from) instead of a copy; None when sharded (no rank holds the model)
    model: tuple[Any, Any] | None = None


LORA_KEYS = ("lora", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")


def run_identity(cfg: RLRunConfig, weights: str, task_ids: Iterable[str] | None) -> dict[str, Any]:
    """What a checkpoint records of the run that wrote it, ``setting -> value``: a resume whose
    values differ is refused (``checkpoint.check_identity``). ``weights``: the fingerprint of the
    weights training starts from (``[model] name``, or the ``[pretrain]`` stage's export);
    ``task_ids``: the training pool (its fingerprint; None: not recorded)."""
    ident: dict[str, Any] = {"model.name": cfg.model.name, "model.weights": weights, "run.seed": cfg.run.seed}
    if task_ids is not None:
        ident["tasks.train_pool"] = names_fingerprint(task_ids)
    ident.update({f"loss.{k}": v for k, v in cfg.loss.model_dump(mode="json").items()})
    ident.update({f"train.{k}": getattr(cfg.train, k) for k in LORA_KEYS})
    return ident


class Learner:
    """The trainer side of an RL run; see the module docstring. ``task_ids``: the training pool,
    for the identity its checkpoints record (None: not recorded, not checked)."""

    def __init__(self, cfg: RLRunConfig, out: Path, start_model: str, dist: distributed.Dist, device: str,
                 task_ids: Iterable[str] | None = None, grown_from: Iterable[str] | None = None):
        self.cfg, self.out, self.start_model, self.device = cfg, out, start_model, device
        task_ids = None if task_ids is None else list(task_ids)
        if grown_from is not None:
            grown_from = list(grown_from)
            if task_ids is None or (gone := sorted(set(grown_from) - set(task_ids))):
                raise ValueError("grown_from: a pool only grows; tasks of the earlier pool missing now: "
                                 f"{gone[:3] if task_ids is not None else 'the pool is not recorded'}")
        model, tok = load_model(start_model, device=device)
        # the weights as loaded, before any update or adapter: what every machine must start from
        self.identity = run_identity(cfg, weights_fingerprint(model), task_ids)
        # a checkpoint written before the pool grew, from these tasks, resumes too (see resume)
        self.grown_identity = None if grown_from is None else {
            **self.identity, "tasks.train_pool": names_fingerprint(grown_from)}
        self._grown_note = None if grown_from is None else (
            f"the training pool grew from {len(grown_from)} to {len(task_ids)} tasks since the checkpoint (every "
            "earlier task still in it); resuming, new checkpoints record it")
        self.resume_warning: str | None = None  # resume(): a checkpoint without an identity
        self.resume_note: str | None = None  # resume(): a checkpoint of the pool before it grew
        self.trainer = Trainer(model, tok, cfg.train.model_copy(update={"temperature": cfg.rollout.temperature}),
                               dist=dist)
        self.ckpt_dir = out / "checkpoints"
        self.start_step = 0  # the step a resumed run continues from (see resume)
        self.ref = None  # the KL reference: the policy RL starts from (see reference())

    @property
    def version(self) -> int:
        return self.trainer.version

    def resume(self) -> tuple[int, dict]:
        """Load the latest checkpoint, if there is one: ``(its step, the state saved with it)``;
        ``(0, {})`` otherwise. The state is the actor's (``Actor.state``)."""
        if not (self.ckpt_dir.exists() and any(self.ckpt_dir.iterdir())):
            return 0, {}
        try:
            self.resume_warning = check_identity(self.ckpt_dir, self.identity)  # before any weights move
        except ConfigError as e:
            if self.grown_identity is None:
                raise
            try:  # written before the pool grew: everything else must agree
                check_identity(self.ckpt_dir, self.grown_identity)
            except ConfigError:
                raise e from None
            self.resume_note = self._grown_note
        if self.resume_warning:
            warnings.warn(self.resume_warning, stacklevel=2)
        state = load_checkpoint(self.ckpt_dir, self.trainer)
        state.pop(IDENTITY, None)  # the learner's record, not the actor's state
        self.start_step = int(state["step"])
        return self.start_step, state

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step of the Composer GRPO variant (+ feedback distillation) on a batch."""
        lc, fb = self.cfg.loss, self.cfg.feedback
        loss_cfg = LossConfig(**lc.loss_kwargs())
        # constant normaliser: the most tokens a batch could hold (no per-sequence averaging)
        normalizer = float(self.cfg.agent.max_tokens * batch.rollouts)
        samples = batch.samples
        if lc.kl_coef == 0:
            # a zero-advantage sample contributes exactly zero gradient without a KL term:
            # skip its forward/backward (a group whose K rewards are equal costs nothing)
            samples = [s for s in samples if s.advantage != 0.0]
        train = dict.fromkeys(("loss", "pg_loss", "kl", "grad_norm", "clip_fraction", "tokens"), 0.0)
        train.update(staleness(batch.samples, self.trainer.version))  # the version this update starts from
        train["samples"] = float(len(samples))
        if samples:
            train.update(self.trainer.rl_backward(samples, loss_cfg, normalizer, self.reference()))
        if batch.pairs:
            train.update(self.trainer.distill_backward(batch.pairs, fb.coef, normalizer))
        if samples or batch.pairs:
            train.update(self.trainer.optimizer_step())
        else:
            train["skipped"] = 1.0
        return train

    def weights(self) -> Weights:
        """The current weights, whole, for the actor. Sharded: a collective (every rank calls
        it, after every update, in step); rank 0 gets the tensors on the CPU."""
        t = self.trainer
        shared = None if distributed.is_sharded(t.model) else t.policy_pair()
        return Weights(t.version, t.full_state_dict(), shared)

    def reference(self):
        """Frozen copy of the policy at the start of RL (after SFT, if any), for the KL term.

        LoRA needs none (the trainer disables the adapters); full fine-tuning keeps a copy,
        reloaded from ``sft_model/`` (or ``start_model``: the base model, or the continued
        pretraining export) when a run resumes.
        """
        if self.cfg.loss.kl_coef == 0 or self.cfg.train.lora:
            return None
        if self.ref is None:
            sharded = distributed.is_sharded(self.trainer.model)
            if self.start_step == 0 and not sharded:
                self.ref = frozen_copy(self.trainer.model)
            else:  # resumed, or sharded (no rank holds the whole policy): what RL started from, from disk
                sft = self.out / "sft_model"  # loaded for this alone: frozen in place, not copied
                self.ref = freeze(load_model(str(sft) if sft.exists() else self.start_model,
                                             device=self.device)[0])
                if sharded:
                    self.ref = distributed.shard_model(self.ref, self.trainer.dist, self.trainer.device,
                                                       self.trainer.bf16)
        return self.ref

    def save(self, step: int, state: dict | None) -> None:
        """A checkpoint after ``step`` when ``[run] save_every`` (or the last step) says so, with
        the actor's ``state`` (None on ranks other than 0, whose state is not written)."""
        r = self.cfg.run
        if step % r.save_every == 0 or step == r.steps:
            save_checkpoint(self.ckpt_dir, self.trainer, state or {}, step, keep=r.keep_checkpoints,
                            identity=self.identity, keep_every=r.keep_every)

    def latest_checkpoint(self) -> Path | None:
        try:
            return resolve_checkpoint(self.ckpt_dir)
        except Exception:
            return None
