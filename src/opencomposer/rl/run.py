"""The RL run: tasks -> K rollouts per task -> test rewards -> group advantages -> update.

    opencomposer train --config configs/demo.toml [--resume]

One step, in named pieces (``RLRun.step``): ``collect_batch`` takes the next unused tasks
(single epoch), collects K rollouts of each through the deployment harness and ``score``s
them (hidden-test rewards, shaping, group advantages with no std division for equal groups,
token-level samples rendered by the same prompt builder the policy used); ``train`` takes
one optimizer step of the Composer GRPO variant; the new weights go to the rollout engine.

``[rollout] max_staleness = 0``: synchronous (weights synced, batch collected, then trained).
``N >= 1``: ``collect_batch`` runs in a thread up to N batches ahead of the trainer
(``rl/async_rollouts.py``), each update reaches the engine in flight (mid-rollout), and
``next_batch`` drops a batch whose oldest token is more than N versions old. Either way a
task counts as used once trained on, so tasks in flight at a stop are collected again after
``--resume``. Metrics go to ``metrics.jsonl`` (and TensorBoard when installed), including
staleness, versions per rollout and where each side waited; checkpoints (weights,
optimizer, sampler state) are written atomically every ``save_every`` steps, so ``--resume``
continues exactly where a run stopped.

Under torchrun (``torchrun --nproc-per-node N -m opencomposer.cli train --config C``) the
trainer is sharded over the ranks (FSDP2, ``train/distributed.py``). Rank 0 is also the
actor: it collects every batch (its engine, its sandboxes, its rollout thread) and
broadcasts it, or its error, to the others; every rank trains on its share; then all of
them gather the new weights to rank 0 (``refresh_weights``, one collective a version),
where the engine, the weight store and the evaluations read them. Logs and metrics are
rank 0's. ``rollout.engine = "hf"`` samples with the trainer's own model, which no single
rank holds, so it is refused there.

Test: ``pytest tests/integration/test_rl_run.py tests/integration/test_async_rl.py``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from opencomposer.config import ConfigError
from opencomposer.harness.prompt import agent_tools
from opencomposer.policies.model import ModelPolicy
from opencomposer.models.registry import load_model
from opencomposer.paths import atomic_write_text
from opencomposer.rl.advantages import advantages_for_groups
from opencomposer.rl.config import RLRunConfig, RolloutSection
from opencomposer.rl.feedback import detect, distill_pairs
from opencomposer.train.loss import LossConfig
from opencomposer.rl.metrics import summarize_groups
from opencomposer.policies.batched import BatchedPolicy
from opencomposer.episode.rollout import Rollout, collect_rollouts, shape_rollouts
from opencomposer.rl.async_rollouts import RolloutsAhead
from opencomposer.train.samples import Sample, trajectory_samples
from opencomposer.rl.sampler import TaskSampler
from opencomposer.rl.staleness import oldest_version, staleness, versions_per_rollout
from opencomposer.rl.taskpool import HarderTasks
from opencomposer.train import distributed
from opencomposer.train.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
from opencomposer.train.trainer import Trainer, freeze, frozen_copy


class MetricsLog:
    """Append-only JSONL of step metrics, plus TensorBoard scalars when available."""

    def __init__(self, out: Path):
        self.path = out / "metrics.jsonl"
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(out / "tb"))
        except Exception:  # tensorboard not installed: JSONL only
            self.tb = None

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, row["step"])
            self.tb.flush()

    def truncate(self, step: int, last_row: dict | None) -> None:
        """On resume: keep rows up to the checkpointed ``step`` (a killed step's row, if
        written, is dropped; the checkpointed step's row is restored from the checkpoint)."""
        rows = [r for r in self.rows() if r["step"] <= step]
        if last_row and not any(r["step"] == step for r in rows):
            rows.append(last_row)
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(l) for l in self.path.read_text().splitlines() if l.strip()]


def rollout_stats(rollouts: list[Rollout], k: int) -> dict[str, float]:
    groups: dict[str, list[float]] = {}
    for r in rollouts:
        groups.setdefault(r.task_id, []).append(r.reward)
    n = max(len(rollouts), 1)
    trajs = [r.result.trajectory for r in rollouts if r.result is not None]
    return {
        **summarize_groups(groups, k),
        "mean_completion_tokens": sum(t.completion_tokens for t in trajs) / n,
        "tool_calls": sum(t.tool_calls for t in trajs) / n,
        "invalid_calls": sum(t.invalid_calls for t in trajs) / n,
        "turns": sum(t.turns for t in trajs) / n,
        "summaries": sum(t.summaries for t in trajs) / n,  # self-summaries per rollout
        "submitted": sum(t.exit_reason == "submitted" for t in trajs) / n,
        "failed_rollouts": sum(r.result is None for r in rollouts),
    }


def sandbox_pool(rollout: RolloutSection):
    """The pool ``[rollout] sandbox_pool`` asks for (a ``BlockingSandboxPool``: episodes
    run in threads), or None for a fresh sandbox per episode. Close it when done."""
    if rollout.sandbox_pool is None:
        return None
    from opencomposer.sandbox.pool import BlockingSandboxPool, SandboxPool

    sp = rollout.sandbox_pool
    return BlockingSandboxPool(SandboxPool(rollout.backend, warm=sp.warm, max_sandboxes=sp.size,
                                           health_check=sp.health_check))


def refuse_unsharded_engine(cfg: RLRunConfig, dist: distributed.Dist) -> None:
    """Under torchrun, ``rollout.engine = "hf"`` is refused (checked before any stage trains)."""
    if dist.enabled and cfg.rollout.engine == "hf":
        raise ConfigError("rollout.engine='hf' samples with the trainer's own model, which torchrun shards "
                          "over the ranks: use rollout.engine='builtin' (rank 0's engine) or 'server'")


@dataclass
class Batch:
    """One step's rollouts, scored: what one optimizer step updates on."""

    paths: list[Path]  # the tasks (in flight in the sampler until trained)
    task_ids: list[str]
    rollouts: list[Rollout]  # K per task, group-major: groups stay whole
    samples: list[Sample]
    pairs: list  # feedback distillation (hinted, original) pairs
    points: list  # feedback failure points
    shaping: dict[str, float]
    oldest: int | None  # the oldest policy version among its sampled tokens
    times: dict[str, float] = field(default_factory=dict)


@dataclass
class RLRun:
    cfg: RLRunConfig
    train_tasks: list[Path]
    out: Path
    resume: bool = False
    on_step: Callable[[dict], None] | None = None
    # the weights training starts from: [model] name, or the export of the pipeline's [pretrain]
    # stage; make_policy(base_model=True) still measures [model] name, the model before any stage
    start_model: str | None = None
    trainer: Trainer = field(init=False)

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        m = self.cfg.model
        self.dist = distributed.init_from_env(m.device)  # a plain process unless started by torchrun
        self.main = self.dist.main  # rank 0: the actor (rollouts, engine, logs)
        self.device = str(distributed.rank_device(self.dist, m.device))
        refuse_unsharded_engine(self.cfg, self.dist)
        self.start_model = self.start_model or m.name
        model, tok = load_model(self.start_model, device=self.device)
        self.trainer = Trainer(model, tok, self.cfg.train.model_copy(update={"temperature": self.cfg.rollout.temperature}),
                               dist=self.dist)
        self.ref = None  # the KL reference: the policy RL starts from (see reference())
        self._gathered: tuple[int, dict] | None = None  # sharded: (version, whole weights on rank 0)
        self.log = MetricsLog(self.out) if self.main else None
        self.ckpt_dir = self.out / "checkpoints"
        self.start_step = 0
        # difficulty on demand: harder tasks from the factory as the pass rate rises (rl/taskpool.py)
        self.harder = HarderTasks(self.cfg.tasks, self.out) if self.cfg.tasks.harder_every and self.main else None
        if self.harder is not None:  # what it made in earlier sessions of this run is in the pool
            self.train_tasks = self.train_tasks + self.harder.made_tasks()
        self.sampler = TaskSampler(self.train_tasks, self.cfg.rollout.tasks_per_step, self.cfg.run.seed)
        if self.resume and self.ckpt_dir.exists() and any(self.ckpt_dir.iterdir()):
            state = load_checkpoint(self.ckpt_dir, self.trainer)
            self.start_step = int(state["step"])
            self.sampler = TaskSampler.from_state(self.train_tasks, state["sampler"])
            if self.harder is not None and "harder" in state:
                self.harder.restore(state["harder"])
            if self.log is not None:
                self.log.truncate(self.start_step, state.get("row"))
        self.refresh_weights()
        # [sync]: every version goes to a weight store for remote followers
        self.publisher = self._publisher() if self.main else None
        self.policy = self.make_policy(self.cfg.rollout.temperature) if self.main else None
        self.tools = agent_tools()
        self.pool = sandbox_pool(self.cfg.rollout) if self.main else None  # closed by run() (or close())
        self.ahead: RolloutsAhead | None = None  # the rollout thread while run() runs, if max_staleness

    def _publisher(self):
        if self.cfg.sync is None:
            return None
        from opencomposer.config import ConfigError
        from opencomposer.sync.publisher import WeightPublisher
        from opencomposer.sync.store import StoreError, open_store
        sc = self.cfg.sync
        try:
            return WeightPublisher(open_store(sc.store), dtype=sc.dtype, full_every=sc.full_every,
                                   keep_full=sc.keep_full, keep_on=sc.keep_on)
        except StoreError as e:
            raise ConfigError(f"[sync] store: {e}") from None

    def make_policy(self, temperature: float, base_model: bool = False) -> BatchedPolicy:
        """A batched sampler on the current weights, or (``base_model``) on a fresh load of
        the untrained model, so the base can be measured at any point of the run.

        ``rollout.engine = "builtin"`` samples with the inference engine, which holds its own
        copy of the weights (``sync_weights`` sends new ones after each update); "hf" samples
        with transformers ``generate`` on the trainer's model itself.
        """
        r, m = self.cfg.rollout, self.cfg.model
        if r.engine == "server" and not base_model:  # the base model is measured locally (the server trains on)
            from opencomposer.policies.server import ServerPolicy

            base = ServerPolicy(r.base_url, self.trainer.tokenizer, temperature=temperature, top_p=r.top_p,
                                max_new_tokens=r.max_new_tokens, seed=self.cfg.run.seed)
            self.publish()  # the server samples the trainer's weights, not its own
            base.wait_for_version(self.trainer.version, r.sync_timeout_s)
            return BatchedPolicy(base, max_batch=r.max_batch)
        if base_model or self.dist.enabled:
            model, tok = load_model(m.name if base_model else self.start_model, device=self.device)
            if not base_model:  # the engine's own copy, of the weights gathered from the shards
                model.load_state_dict(self.weights())
        else:
            model, tok = self.trainer.policy_pair()
        version = 0 if base_model else self.trainer.version
        if r.engine == "builtin":
            from opencomposer.inference.engine.core import Engine
            from opencomposer.policies.engine import EnginePolicy

            engine = Engine(model, tok, max_num_seqs=r.max_batch, device=self.device, policy_version=version,
                            max_model_len=min(int(model.config.max_position_embeddings), 8192))
            base = EnginePolicy(engine, temperature=temperature, top_p=r.top_p,
                                max_new_tokens=r.max_new_tokens, seed=self.cfg.run.seed)
        else:
            base = ModelPolicy((model, tok), temperature=temperature, top_p=r.top_p,
                               max_new_tokens=r.max_new_tokens, seed=self.cfg.run.seed, policy_version=version)
        return BatchedPolicy(base, max_batch=r.max_batch)

    def sync_weights(self, wait: bool = True) -> None:
        """Make the rollout policy sample from the trainer's current weights (and say so).

        The built-in engine takes them between two decode steps, in flight if rollouts are
        running (``max_staleness``); a server gets them through the store, and ``wait=False``
        leaves it to apply them when its follower polls (its tokens then say which version ran).
        """
        if self.policy.policy_version == self.trainer.version:
            return
        if self.cfg.rollout.engine == "server":  # through the weight store: publish, then wait for the server
            self.publish()
            if wait:
                self.policy.policy.wait_for_version(self.trainer.version, self.cfg.rollout.sync_timeout_s)
        elif self.cfg.rollout.engine == "builtin":
            self.policy.policy.update_weights(self.weights(), self.trainer.version)
        else:  # same model object: only the label moves
            self.policy.policy_version = self.trainer.version

    def publish(self) -> dict[str, float]:
        """Send the trainer's current version to the weight store (``[sync]``), once; the
        metrics row gets what it cost."""
        if self.publisher is None or self.publisher.version == self.trainer.version:
            return {}
        s = self.publisher.publish(self.weights(), self.trainer.version)
        return {"sync_kind_full": float(s["kind"] == "full"), "sync_stored_mb": s["stored_bytes"] / 2**20,
                "sync_compression": s["compression"], "sync_changed_fraction": s["changed_fraction"],
                "time_sync": round(s["seconds"], 3)}

    def refresh_weights(self) -> None:
        """Sharded: gather the trainer's weights to rank 0 for the engine and the store (a
        collective: every rank calls it after every update, in step). One process: nothing."""
        if self.dist.enabled:
            self._gathered = (self.trainer.version, self.trainer.full_state_dict())

    def weights(self) -> dict:
        """The trainer's current weights, whole, under HF names (rank 0's view when sharded)."""
        if not self.dist.enabled:
            return self.trainer.model.state_dict()
        version, weights = self._gathered or (None, {})
        if version != self.trainer.version:
            raise RuntimeError(f"weights gathered at version {version}, the trainer is at {self.trainer.version}: "
                               "call refresh_weights() on every rank after an update")
        return weights

    # ------------------------------------------------------------------ one step, in pieces

    def collect_batch(self) -> Batch:
        """The next unused tasks -> K rollouts each -> scored samples (in the rollout thread
        when rollouts run ahead; there the engine's weights move on their own)."""
        from opencomposer.tasks.format import Task

        r, t0 = self.cfg.rollout, time.perf_counter()
        paths = self.sampler.issue()
        tasks = [Task.load(p) for p in paths]
        if not r.max_staleness:
            self.sync_weights()
        gen0 = self.policy.stats.get("generate_seconds", 0.0)
        rollouts = collect_rollouts(tasks, r.k, self.policy, r.backend, self.cfg.agent,
                                    max_concurrent=r.k * r.tasks_per_step,
                                    sandboxes=self.pool.lease if self.pool is not None else None)
        t1 = time.perf_counter()
        batch = self.score(paths, [t.id for t in tasks], rollouts)
        reward_s = sum(ro.result.seconds.get("reward", 0.0) for ro in rollouts if ro.result is not None)
        batch.times = {"time_rollout": round(t1 - t0, 2),
                       "time_generate": round(self.policy.stats.get("generate_seconds", 0.0) - gen0, 2),
                       "time_reward_cpu": round(reward_s, 2), "time_samples": round(time.perf_counter() - t1, 2)}
        return batch

    def score(self, paths: list[Path], task_ids: list[str], rollouts: list[Rollout]) -> Batch:
        """Shaped rewards -> group advantages -> token samples (and feedback pairs)."""
        shaping = shape_rollouts(rollouts, self.cfg.reward)
        groups: dict[str, list[float]] = {}
        for ro in rollouts:
            groups.setdefault(ro.task_id, []).append(ro.train_reward)
        adv = advantages_for_groups(groups, std_normalize=self.cfg.loss.std_normalize)
        seen: dict[str, int] = {}
        samples = []
        for ro in rollouts:
            i = seen.get(ro.task_id, 0)
            seen[ro.task_id] = i + 1
            if ro.result is not None:
                samples += trajectory_samples(ro.result.trajectory, self.trainer.tokenizer, self.tools,
                                              adv[ro.task_id][i], group_id=ro.task_id)
        fb = self.cfg.feedback
        points, pairs = [], []  # targeted textual feedback: hints at failure points, distilled
        for ro in rollouts if fb.enabled else []:
            if ro.result is not None:
                found = detect(ro.result.trajectory, fb)
                points += found
                pairs += distill_pairs(ro.result.trajectory, found, self.trainer.tokenizer, self.tools)
        return Batch(paths, task_ids, rollouts, samples, pairs, points, shaping, oldest_version(rollouts))

    def train(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the Composer GRPO variant (+ feedback distillation) on a batch."""
        lc, fb = self.cfg.loss, self.cfg.feedback
        loss_cfg = LossConfig(clip_low=lc.clip_low, clip_high=lc.clip_high, kl_coef=lc.kl_coef,
                              kl_estimator=lc.kl_estimator)
        # constant normaliser: the most tokens a batch could hold (no per-sequence averaging)
        normalizer = float(self.cfg.agent.max_tokens * len(batch.rollouts))
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
        if fb.enabled:
            kinds = [p.kind for p in batch.points]
            train.update({"feedback_points": float(len(kinds)),
                          **{f"feedback_{k}": float(kinds.count(k)) for k in fb.detectors}})
        return train

    def next_batch(self) -> tuple[Batch, float, int]:
        """(batch, seconds the trainer waited for it, batches dropped as too stale).

        Synchronous: collected now, with the trainer's weights. Ahead: the rollout thread's
        next batch, trained only if its oldest token is at most ``max_staleness`` versions
        behind the trainer; a staler one (a server that lags, a slow step) is dropped, its
        tasks handed out again."""
        n = self.cfg.rollout.max_staleness
        if self.ahead is None:
            t0 = time.perf_counter()
            return self.collect_batch(), time.perf_counter() - t0, 0
        waited, dropped = 0.0, 0
        while True:
            batch, w = self.ahead.get()
            waited += w
            if batch.oldest is None or batch.oldest >= self.trainer.version - n:
                return batch, waited, dropped
            self.sampler.release(batch.paths)
            self.ahead.redo()
            dropped += 1

    def shared_batch(self) -> tuple[Batch, float, int]:
        """``next_batch`` on rank 0, the same on every rank (one process: just ``next_batch``).
        A failure on rank 0 reaches the others as an error, not as a wait without end."""
        return distributed.on_main(self.dist, self.next_batch, "rank 0 stopped the run while collecting rollouts")

    def step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        idle0 = self.ahead.idle_seconds if self.ahead is not None else 0.0
        batch, waited, dropped = self.shared_batch()
        t1 = time.perf_counter()
        train = self.train(batch)
        if self.main:
            self.sampler.trained(batch.paths)  # only now: tasks in flight at a stop are handed out again
        self.refresh_weights()
        if not self.main:
            return {"step": step + 1}
        t2 = time.perf_counter()
        sync = self.publish()
        if self.ahead is not None:
            self.sync_weights(wait=False)  # in flight: the rollouts running now continue on them
        t3 = time.perf_counter()
        r = self.cfg.rollout
        # the engine idles while a synchronous step trains; ahead, while the thread waits for room
        rollout_idle = (self.ahead.idle_seconds - idle0) if self.ahead is not None else t3 - t1
        return {
            "step": step + 1, **rollout_stats(batch.rollouts, r.k), **batch.shaping,
            "task_ids": batch.task_ids,
            "samples": int(train["samples"]), "train_tokens": train.get("tokens", 0.0),
            **{k: train[k] for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_fraction") if k in train},
            **{k: v for k, v in train.items() if k.startswith(("distill_", "feedback_"))},
            "replayed_route_tokens": train.get("replayed_route_tokens", 0.0),  # MoE: router replay
            "update_skipped": bool(train.get("skipped", 0.0)),
            **batch.times, "time_train": round(t2 - t1, 2),
            "time_step": round(t3 - t0, 2), "time_wait_rollouts": round(waited, 2),
            "time_rollout_idle": round(rollout_idle, 2),
            "staleness_mean": train["staleness_mean"], "staleness_max": train["staleness_max"],
            **versions_per_rollout(batch.rollouts), "dropped_stale": dropped,
            "policy_version": self.trainer.version,
            **sync,
        }

    def reference(self):
        """Frozen copy of the policy at the start of RL (after SFT, if any), for the KL term.

        LoRA needs none (the trainer disables the adapters); full fine-tuning keeps a copy,
        reloaded from ``sft_model/`` (or ``start_model``: the base model, or the continued
        pretraining export) when a run resumes.
        """
        if self.cfg.loss.kl_coef == 0 or self.cfg.train.lora:
            return None
        if self.ref is None:
            if self.start_step == 0 and not self.dist.enabled:
                self.ref = frozen_copy(self.trainer.model)
            else:  # resumed, or sharded (no rank holds the whole policy): what RL started from, from disk
                sft = self.out / "sft_model"  # loaded for this alone: frozen in place, not copied
                self.ref = freeze(load_model(str(sft) if sft.exists() else self.start_model,
                                             device=self.device)[0])
                if self.dist.enabled:
                    self.ref = distributed.shard_model(self.ref, self.dist, self.trainer.device, self.trainer.bf16)
        return self.ref

    def run(self) -> list[dict]:
        rows = []
        self.reference()
        self.publish()  # followers start from the weights RL starts from
        try:
            if self.main and self.cfg.rollout.max_staleness:  # rollouts run ahead in a thread (rl/async_rollouts.py)
                self.ahead = RolloutsAhead(self.collect_batch, self.cfg.rollout.max_staleness,
                                           total=self.cfg.run.steps - self.start_step,
                                           interrupt=self.policy.close).start()
            for step in range(self.start_step, self.cfg.run.steps):
                row = self.step(step)
                if self.main and self.harder is not None:
                    row.update(self.harder.after_step(step + 1, row["pass@1"], self.sampler))
                # checkpoint first (atomic), then the metrics row: a kill in between loses
                # nothing, since the row travels in the checkpoint (see MetricsLog.truncate)
                if (step + 1) % self.cfg.run.save_every == 0 or step + 1 == self.cfg.run.steps:
                    extra = {"harder": self.harder.state()} if self.harder is not None else {}
                    save_checkpoint(self.ckpt_dir, self.trainer,
                                    {"sampler": self.sampler.state(), "row": row, **extra},
                                    step + 1, keep=self.cfg.run.keep_checkpoints)
                if not self.main:
                    continue
                self.log.write(row)
                rows.append(row)
                if self.on_step:
                    self.on_step(row)
        finally:
            self.close()
        return rows

    def close(self) -> None:
        """Stop the rollout thread, if any (a collection in progress is cut short, its
        sandboxes closed), then the sandbox pool, if the run has one (every sandbox it made goes)."""
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def latest_checkpoint(self) -> Path | None:
        try:
            return resolve_checkpoint(self.ckpt_dir)
        except Exception:
            return None
