"""The actor of an RL run: tasks -> K rollouts per task -> scored token samples, and the
learner's weights published to the rollout engine and the weight store.

    actor = Actor(cfg, train_tasks, out, tokenizer, learner.weights(), device="cpu", start_model=m)
    batch = actor.next_batch()                     # rollouts, rewards, advantages, samples
    metrics = learner.update(batch.train)          # the learner's side (rl/learner.py)
    published = actor.publish(learner.weights(), batch)
    actor.log(actor.report(step, batch, metrics, published))

``collect_batch`` takes the next unused tasks (single epoch, ``rl/sampler.py``), runs K
rollouts of each through the deployment harness (``episode/run.py``: ``collect_rollouts`` -> ``run_task``)
and ``score``s them: hidden-test rewards, shaping, group advantages with no std division for
equal groups (``rl/advantages.py``), token-level samples rendered by the same prompt builder
the policy used (``train/samples.py``), feedback distillation pairs (``rl/feedback.py``).

``[rollout] max_staleness = 0``: synchronous; the engine takes the learner's weights before a
batch is collected. ``N >= 1``: ``start`` runs ``collect_batch`` in a thread up to N batches
ahead of the learner (``rl/async_rollouts.py``), each update reaches the engine in flight
(``publish``: mid-rollout), and ``next_batch`` drops a batch whose oldest token is more than
N versions older than the learner's weights. A task counts as used once trained on
(``publish``), so tasks in flight at a stop are collected again after ``--resume``.

Several rollout engines (``[rollout] engines``, ``base_urls``): ``rl/engines.py`` builds them
behind a ``FanoutPolicy`` (a group's rollouts on one engine), ``sync_weights`` updates every
one (a failed one rebuilt first), and the step's row has each engine's ``engine_episodes_<i>``,
``engine_requests_<i>``, ``engine_generate_s_<i>``, ``engine_failures_<i>`` and
``engine_version_<i>`` (the version it ran at the collection's end), with ``engines_up``
and ``engine_groups_split`` (groups that ran on more than one: an engine failed under them).

Under torchrun the actor lives on rank 0 alone (``distributed.main_only``): its engine, its
sandboxes, its rollout thread, the metrics log and the evaluations' policies (``make_policy``).

Test: ``pytest tests/integration/test_rl_run.py tests/integration/test_async_rl.py
tests/unit/rl/test_informative.py`` (zero-variance groups kept, skipped, resampled);
``pytest tests/integration/test_rl_engines.py`` (two engines).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opencomposer.episode.run import Rollout, collect_rollouts, shape_rollouts
from opencomposer.harness.prompt import agent_tools
from opencomposer.policies.batched import BatchedPolicy
from opencomposer.policies.fanout import FanoutPolicy
from opencomposer.rl.advantages import GroupSplit, advantages_for_groups, split_groups
from opencomposer.rl.async_rollouts import RolloutsAhead
from opencomposer.rl.config import RLRunConfig, RolloutSection
from opencomposer.rl.engines import (
    model_config,
    rollout_engines,
    rollout_policy,
    sync_engines,
)
from opencomposer.rl.external_engine import EXTERNAL, ExternalEngine
from opencomposer.rl.feedback import detect, distill_pairs
from opencomposer.rl.learner import TrainBatch, Weights
from opencomposer.rl.metrics import MetricsLog, rollout_stats, rollout_times
from opencomposer.rl.sampler import TaskSampler
from opencomposer.rl.staleness import oldest_version, versions_per_rollout
from opencomposer.rl.taskpool import HarderTasks, task_sampler
from opencomposer.rl.transcripts import KeptTranscripts
from opencomposer.train.samples import Sample, trajectory_samples

ENGINE_COUNTS = ("prompt_tokens", "prefill_tokens_computed", "generated_tokens", "steps", "prefill_seconds",
                 "decode_seconds", "step_seconds", "step_cpu_seconds", "step_runqueue_seconds")


@dataclass
class Batch:
    """One step's rollouts, scored: the learner updates on ``train``, the rest is the step's row."""

    paths: list[Path]  # every task drawn for it (in flight in the sampler until trained; then all used)
    task_ids: list[str]
    rollouts: list[Rollout]  # K per task trained on, group-major: groups stay whole
    samples: list[Sample]
    pairs: list  # feedback distillation (hinted, original) pairs
    points: list  # feedback failure points
    shaping: dict[str, float]
    oldest: int | None  # the oldest policy version among its sampled tokens
    times: dict[str, float] = field(default_factory=dict)  # of its collection (time_rollout, ...)
    waited: float = 0.0  # seconds the learner waited for it (next_batch)
    dropped: int = 0  # staler batches dropped before it
    marks: dict[str, float] = field(default_factory=dict)  # perf_counter of its step: start, handed; idle
    # [rollout] zero_variance: every rollout drawn (``rollouts`` less the groups left out; the
    # row's pass rates are of these), each task's K task rewards (the sampler's estimates), and
    # the groups_* counts of the step's row
    drawn: list[Rollout] = field(default_factory=list)
    outcomes: dict[str, list[float]] = field(default_factory=dict)  # task dir name -> K task rewards
    groups: dict[str, float] = field(default_factory=dict)

    @property
    def train(self) -> TrainBatch:
        """All the learner gets of it."""
        return TrainBatch(self.samples, self.pairs, len(self.rollouts))


@dataclass(frozen=True)
class Published:
    """What ``Actor.publish`` measured of a step, for its row."""

    train_s: float  # from handing the batch over to getting the new weights back (the learner's update)
    publish_s: float  # the weights to the store and (ahead) to the engine
    step_s: float  # the whole step, from asking for the batch to the weights published
    rollout_idle_s: float  # the engine without work: a synchronous step's update; ahead, the thread waiting
    sync: dict[str, float]  # what the weight store cost (``publish_to_store``), {} without [sync]


def sandbox_pool(rollout: RolloutSection):
    """The pool ``[rollout] sandbox_pool`` asks for (a ``BlockingSandboxPool``: episodes
    run in threads), or None for a fresh sandbox per episode. Close it when done."""
    if rollout.sandbox_pool is None:
        return None
    from opencomposer.sandbox.pool import BlockingSandboxPool, SandboxPool

    sp = rollout.sandbox_pool
    return BlockingSandboxPool(SandboxPool(rollout.backend, warm=sp.warm, max_sandboxes=sp.size,
                                           health_check=sp.health_check))


def _split(rollouts: list[Rollout], on: str = "shaped") -> GroupSplit:
    """``split_groups`` of rollouts: zero variance by the shaped reward the update uses (``on`` 'shaped')
    or by the task reward (``on`` 'task': ``[rollout] zero_variance_on``), all-pass / all-fail by the
    task reward."""
    train: dict[str, list[float]] = {}
    task: dict[str, list[float]] = {}
    for ro in rollouts:
        train.setdefault(ro.task_id, []).append(ro.train_reward)
        task.setdefault(ro.task_id, []).append(ro.reward)
    return split_groups(task if on == "task" else train, task)


def _pooled(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Means over several collections (``shape_rollouts``' per-rollout means, each with its count)."""
    n = sum(c for c, _ in parts) or 1
    keys = list(dict.fromkeys(k for _, d in parts for k in d))
    return {k: sum(c * d.get(k, 0.0) for c, d in parts) / n for k in keys}


class Actor:
    """The rollout side of an RL run; see the module docstring. ``state`` is what a resumed
    run's checkpoint saved of it (``Actor.state``), {} on a fresh run."""

    def __init__(self, cfg: RLRunConfig, train_tasks: list[Path], out: Path, tokenizer: Any, weights: Weights,
                 device: str, start_model: str, on_step: Callable[[dict], None] | None = None,
                 start_step: int = 0, state: dict | None = None):
        self.cfg, self.out, self.tokenizer, self.weights = cfg, out, tokenizer, weights
        self.device, self.start_model, self.on_step = device, start_model, on_step
        self.metrics = MetricsLog(out)
        self.rows: list[dict] = []  # logged in this session (``logged``)
        # difficulty on demand: harder tasks from the factory as the pass rate rises (rl/taskpool.py)
        self.harder = HarderTasks(cfg.tasks, out) if cfg.tasks.harder_every else None
        if self.harder is not None:  # what it made in earlier sessions of this run is in the pool
            train_tasks = train_tasks + self.harder.made_tasks()
        # uniform or informative draws ([tasks] sampling), from the checkpoint's state on resume
        self.sampler: TaskSampler = task_sampler(cfg.tasks, train_tasks, cfg.rollout.tasks_per_step, cfg.run.seed,
                                                 state["sampler"] if state else None)
        if state:
            if self.harder is not None and "harder" in state:
                self.harder.restore(state["harder"])
            self.metrics.truncate(start_step, state.get("row"))
        # the transcripts of the passed and flagged rollouts ([rollout] keep_transcripts), a folder a step
        self.kept = KeptTranscripts(out, cfg.rollout.keep_transcripts, cfg.rollout.keep_transcripts_sample,
                                    cfg.run.seed)
        if state:
            self.kept.truncate(start_step)
        # [sync]: every version goes to a weight store for remote followers
        self.publisher = self._publisher()
        # [cluster]: engine actors and sandbox hosts on Ray (rl/cluster.py); the engines are this run's servers
        self.cluster = self._cluster()
        try:
            cfg = self.cfg  # with the cluster's engines as its servers
            # [rollout] engine = "vllm" | "sglang": the server's checks and weight pushes
            self.external = (ExternalEngine(cfg, model_config(weights, start_model))
                             if cfg.rollout.engine in EXTERNAL else None)
            # the rollouts' engine, or [rollout] engines of them behind a FanoutPolicy (rl/engines.py)
            replace = self.cluster.replace if self.cluster is not None and self.cluster.engines else None
            self.policy: BatchedPolicy | FanoutPolicy = rollout_engines(
                cfg, lambda: self.weights, tokenizer, cfg.rollout.temperature, device, start_model,
                publish=self.publish_to_store, external=self.external, replace_server=replace)
        except BaseException:
            if self.cluster is not None:
                self.cluster.close()
            raise
        self.tools = agent_tools(cfg.agent)  # the schemas its episodes were given
        self.pool = sandbox_pool(cfg.rollout)  # closed by close()
        self.ahead: RolloutsAhead | None = None  # the rollout thread while the run runs, if max_staleness

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

    def _cluster(self):
        if self.cfg.cluster is None:
            return None

        from opencomposer.rl.cluster import RayCluster

        cluster = RayCluster.start(self.cfg, [Path(self.cfg.tasks.dir)], self.cfg.model.name)
        if cluster.urls:  # rollout.engine = "server" over the actors (RLRunConfig checked that)
            r = self.cfg.rollout.model_copy(update={"base_urls": cluster.urls})
            self.cfg = self.cfg.model_copy(update={"rollout": r})
        self._write_placement(cluster)
        return cluster

    def _write_placement(self, cluster) -> None:
        import json

        from opencomposer.paths import atomic_write_text

        atomic_write_text(self.out / "cluster.json", json.dumps(cluster.placement(), indent=1))

    def make_policy(self, temperature: float, base_model: bool = False) -> BatchedPolicy:
        """A batched sampler on the latest weights, one engine (``rollout_policy``): the evaluations'.
        On a Ray cluster: engine 0's actor as it is now (replaced ones have a new URL)."""
        server = self.cluster.urls[0] if self.cluster is not None and self.cluster.engines else None
        return rollout_policy(self.cfg, self.weights, self.tokenizer, temperature, self.device, self.start_model,
                              base_model=base_model, publish=self.publish_to_store, external=self.external,
                              server=server)

    # ------------------------------------------------------------------ weights from the learner

    def take(self, weights: Weights) -> None:
        """The learner's latest weights: the next policy, sync and publication use them."""
        self.weights = weights

    def sync_weights(self, wait: bool = True) -> dict[str, float]:
        """Make the rollout engines sample from the latest weights (``rl/engines.sync_engines``:
        a failed built-in engine rebuilt first; ``wait=False``: a server applies them when its
        follower polls); what a vLLM or SGLang push cost, for the step's row ({} otherwise)."""
        return sync_engines(self.policy, self.cfg, self.weights, self.publish_to_store, wait, self.external)

    def publish_to_store(self) -> dict[str, float]:
        """Send the latest version to the weight store (``[sync]``), once; the metrics row
        gets what it cost."""
        w = self.weights
        if self.publisher is None or self.publisher.version == w.version:
            return {}
        s = self.publisher.publish(w.state, w.version)
        return {"sync_kind_full": float(s["kind"] == "full"), "sync_stored_mb": s["stored_bytes"] / 2**20,
                "sync_compression": s["compression"], "sync_changed_fraction": s["changed_fraction"],
                "time_sync": round(s["seconds"], 3)}

    # ------------------------------------------------------------------ one step, in pieces

    def start(self, steps: int) -> None:
        """Before the first step: followers get the weights RL starts from, and rollouts start
        running ahead in a thread (``max_staleness``) for the ``steps`` to come."""
        self.publish_to_store()
        n = self.cfg.rollout.max_staleness
        if n:  # (rl/async_rollouts.py)
            self.sync_weights(wait=False)  # the engine starts from them too (an SFT stage moved them)
            self.ahead = RolloutsAhead(self.collect_batch, n, total=steps, interrupt=self.policy.close).start()

    def collect_batch(self) -> Batch:
        """The next unused tasks -> K rollouts each -> scored samples (in the rollout thread
        when rollouts run ahead; there the engine's weights move on their own).

        ``[rollout] zero_variance``: a group whose K rewards are all equal (``split_groups``) is
        trained on ("keep"), left out ("skip"), or left out and replaced by further tasks drawn
        until the batch holds ``tasks_per_step`` informative groups ("resample", DAPO's dynamic
        sampling: at most ``max_resample_rounds`` collections and ``max_resample_groups`` extra
        tasks, or the pool's end). Every task drawn counts as used once the batch is trained."""
        r, t0 = self.cfg.rollout, time.perf_counter()
        paths = self.sampler.issue()
        pushed = self.sync_weights() if not r.max_staleness else {}
        gen0, eng0, per0 = dict(self.policy.stats), self._engine_counts(), self._per_engine()
        task_ids, rollouts = self._roll(paths)
        shaped = [(len(rollouts), shape_rollouts(rollouts, self.cfg.reward))]
        split = _split(rollouts, r.zero_variance_on)
        rounds = extra = 0
        cap = r.max_resample_groups
        while (r.zero_variance == "resample" and len(split.informative) < r.tasks_per_step
               and rounds < r.max_resample_rounds and (cap is None or extra < cap)):
            need = r.tasks_per_step - len(split.informative)
            more = self.sampler.issue(need if cap is None else min(need, cap - extra), allow_fewer=True)
            if not more:  # the pool's end
                break
            rounds, extra = rounds + 1, extra + len(more)
            ids, ros = self._roll(more)
            shaped.append((len(ros), shape_rollouts(ros, self.cfg.reward)))
            split.extend(_split(ros, r.zero_variance_on))
            paths, task_ids, rollouts = paths + more, task_ids + ids, rollouts + ros
        left_out = set(split.zero_variance) if r.zero_variance != "keep" else set()
        t1 = time.perf_counter()
        batch = self.score(paths, task_ids, [ro for ro in rollouts if ro.task_id not in left_out],
                           shaping=_pooled(shaped))
        batch.drawn = rollouts
        batch.outcomes = {Path(p).name: [ro.reward for ro in rollouts if ro.task_id == tid]
                          for p, tid in zip(paths, task_ids)}
        batch.groups = {**split.metrics(), "groups_drawn": float(len(paths)),
                        "groups_trained": float(len(paths) - len(left_out)),
                        "groups_resampled": float(extra), "resample_rounds": float(rounds)}
        reward_s = sum(ro.result.seconds.get("reward", 0.0) for ro in rollouts if ro.result is not None)
        gen = {k: v - gen0.get(k, 0) for k, v in self.policy.stats.items()}
        batch.times = {"time_rollout": round(t1 - t0, 2), "time_generate": round(gen.get("generate_seconds", 0.0), 2),
                       # sequences per engine step (continuous) or per batch, this step's
                       "generate_mean_running": round(gen.get("sequence_steps", 0) / max(gen.get("batches", 0), 1), 2),
                       "time_reward_cpu": round(reward_s, 2), "time_samples": round(time.perf_counter() - t1, 2),
                       # the batching worker's CPU time within time_generate (the rest: waiting, device or GIL)
                       "time_generate_cpu": round(gen.get("worker_cpu_seconds", 0.0), 2),
                       **rollout_times(rollouts, gen, self._engine_counts(eng0)),
                       **self._per_engine(per0, rollouts), **pushed}
        return batch

    def _per_engine(self, since: dict[str, float] | None = None,
                    rollouts: list[Rollout] | None = None) -> dict[str, float]:
        """Several engines: each one's episodes, requests, generate seconds and failures
        (``FanoutPolicy.figures``, minus ``since``) and the version it runs, how many are up,
        and how many groups ran on more than one (an engine failed under them); {} with one engine."""
        if not isinstance(self.policy, FanoutPolicy):
            return {}
        now = self.policy.figures()
        if since is None:
            return now
        engines: dict[str, set] = {}
        for ro in rollouts or []:
            if ro.engine is not None:
                engines.setdefault(ro.task_id, set()).add(ro.engine)
        return {**{k: round(v - since.get(k, 0.0), 3) for k, v in now.items()},
                **{f"engine_version_{i}": float(v) for i, v in self.policy.versions().items()},
                "engines_up": float(self.policy.up),
                "engine_groups_split": float(sum(len(e) > 1 for e in engines.values()))}

    def _engine_counts(self, since: dict[str, float] | None = None) -> dict[str, float] | None:
        """The built-in engine's running counts (``Engine.counts``; None without one), minus ``since``."""
        counts = self.policy.engine_counts()  # several engines: summed (replaced ones included)
        if not counts:
            return None
        now = {k: float(v) for k, v in counts.items() if k in ENGINE_COUNTS}
        return now if since is None else {k: v - since.get(k, 0.0) for k, v in now.items()}

    def _roll(self, paths: list[Path]) -> tuple[list[str], list[Rollout]]:
        """K rollouts of each task (group-major) and the tasks' ids."""
        from opencomposer.tasks.format import Task

        r = self.cfg.rollout
        tasks = [Task.load(p) for p in paths]
        # the actor lives on rank 0 alone (distributed.main_only), so it always shows its progress
        rollouts = collect_rollouts(tasks, r.k, self.policy, r.backend, self.cfg.agent,
                                    max_concurrent=r.k * r.tasks_per_step,
                                    sandboxes=self._sandboxes(),
                                    progress="rollouts")
        return [t.id for t in tasks], rollouts

    def _sandboxes(self) -> Callable[[Any], Any] | None:
        """Where episodes get sandboxes: the pool, the cluster's hosts, or (None) fresh local ones."""
        if self.pool is not None:
            return self.pool.lease
        if self.cluster is not None and self.cluster.sandboxes is not None:
            return self.cluster.sandbox
        return None

    def score(self, paths: list[Path], task_ids: list[str], rollouts: list[Rollout],
              shaping: dict[str, float] | None = None) -> Batch:
        """Shaped rewards -> group advantages -> token samples (and feedback pairs). ``shaping``:
        the rollouts were shaped already (``collect_batch``), these are the row's means."""
        shaping = shape_rollouts(rollouts, self.cfg.reward) if shaping is None else shaping
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
                samples += trajectory_samples(ro.result.trajectory, self.tokenizer, self.tools,
                                              adv[ro.task_id][i], group_id=ro.task_id)
        fb = self.cfg.feedback
        points, pairs = [], []  # targeted textual feedback: hints at failure points, distilled
        for ro in rollouts if fb.enabled else []:
            if ro.result is not None:
                found = detect(ro.result.trajectory, fb)
                points += found
                pairs += distill_pairs(ro.result.trajectory, found, self.tokenizer, self.tools)
        return Batch(paths, task_ids, rollouts, samples, pairs, points, shaping, oldest_version(rollouts))

    def next_batch(self) -> Batch:
        """The batch the learner updates on next (``waited``: how long it waited; ``dropped``:
        batches dropped as too stale).

        Synchronous: collected now, with the latest weights. Ahead: the rollout thread's
        next batch, trained only if its oldest token is at most ``max_staleness`` versions
        behind the learner's weights; a staler one (a server that lags, a slow step) is
        dropped, its tasks handed out again."""
        t0 = time.perf_counter()
        idle0 = self.ahead.idle_seconds if self.ahead is not None else 0.0
        batch = self._next_batch()
        batch.marks = {"start": t0, "idle": idle0, "handed": time.perf_counter()}
        return batch

    def _next_batch(self) -> Batch:
        n = self.cfg.rollout.max_staleness
        if self.ahead is None:
            t0 = time.perf_counter()
            batch = self.collect_batch()
            batch.waited = time.perf_counter() - t0
            return batch
        waited, dropped = 0.0, 0
        while True:
            batch, w = self.ahead.get()
            waited += w
            if batch.oldest is None or batch.oldest >= self.weights.version - n:
                batch.waited, batch.dropped = waited, dropped
                return batch
            self.sampler.release(batch.paths)
            self.ahead.redo()
            dropped += 1

    def publish(self, weights: Weights, batch: Batch) -> Published:
        """After the learner's update on ``batch``: its tasks are used for good, and its new
        ``weights`` go to the weight store and, while rollouts run ahead, to the engine in
        flight (the rollouts running now continue on them)."""
        # only now: tasks in flight at a stop are handed out again; the groups' task rewards
        # (all drawn, left out or not) update the estimates of informative sampling
        self.sampler.trained(batch.paths, batch.outcomes)
        t2 = time.perf_counter()
        self.take(weights)
        sync = self.publish_to_store()
        if self.ahead is not None:
            self.sync_weights(wait=False)
        t3 = time.perf_counter()
        m = batch.marks
        # the engine idles while a synchronous step trains; ahead, while the thread waits for room
        idle = (self.ahead.idle_seconds - m["idle"]) if self.ahead is not None else t3 - m["handed"]
        return Published(train_s=t2 - m["handed"], publish_s=t3 - t2, step_s=t3 - m["start"], rollout_idle_s=idle,
                         sync=sync)

    def report(self, step: int, batch: Batch, train: dict[str, float], published: Published) -> dict[str, Any]:
        """The metrics row of ``step``: the batch's rollouts, the learner's ``train`` metrics,
        what ``publish`` measured; and, with harder tasks on, what the factory was told. The
        transcripts ``[rollout] keep_transcripts`` keeps are written here, before the checkpoint."""
        r, fb, p = self.cfg.rollout, self.cfg.feedback, published
        kept = self.kept.keep(step, batch.drawn or batch.rollouts)
        feedback = {}
        if fb.enabled:
            kinds = [pt.kind for pt in batch.points]
            feedback = {"feedback_points": float(len(kinds)),
                        **{f"feedback_{k}": float(kinds.count(k)) for k in fb.detectors}}
        row = {
            "step": step, **rollout_stats(batch.drawn or batch.rollouts, r.k), **batch.shaping,
            **batch.groups, **self.sampler.metrics(),
            "task_ids": batch.task_ids,
            "samples": int(train["samples"]), "train_tokens": train.get("tokens", 0.0),
            **{k: train[k] for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_fraction",
                                     "mismatch_kl", "mismatch_max", "is_corrected_fraction") if k in train},
            **{k: v for k, v in train.items() if k.startswith("distill_")}, **feedback,
            "replayed_route_tokens": train.get("replayed_route_tokens", 0.0),  # MoE: router replay
            "update_skipped": bool(train.get("skipped", 0.0)),
            **batch.times, "time_train": round(p.train_s, 2), "time_publish": round(p.publish_s, 2),
            **{k: round(train[k], 2) for k in ("time_update", "time_weights", "time_train_cpu") if k in train},
            "time_step": round(p.step_s, 2), "time_wait_rollouts": round(batch.waited, 2),
            "time_rollout_idle": round(p.rollout_idle_s, 2),
            "staleness_mean": train["staleness_mean"], "staleness_max": train["staleness_max"],
            **versions_per_rollout(batch.rollouts), "dropped_stale": batch.dropped,
            "policy_version": self.weights.version, "transcripts_kept": len(kept),
            **p.sync,
        }
        if self.harder is not None:
            row.update(self.harder.after_step(step, row["pass@1"], self.sampler))
        return row

    def state(self, row: dict) -> dict:
        """What a checkpoint keeps of the actor (``row``: the step's, restored on resume)."""
        extra = {"harder": self.harder.state()} if self.harder is not None else {}
        return {"sampler": self.sampler.state(), "row": row, **extra}

    def log(self, row: dict) -> None:
        """The row to ``metrics.jsonl`` (after its checkpoint: a kill in between loses nothing,
        since the row travels in the checkpoint, see ``MetricsLog.truncate``), then ``on_step``."""
        self.metrics.write(row)
        self.rows.append(row)
        if self.on_step:
            self.on_step(row)

    def logged(self) -> list[dict]:
        """The rows ``log`` wrote in this session."""
        return list(self.rows)

    def close(self) -> None:
        """Stop the rollout thread, if any (a collection in progress is cut short, its
        sandboxes closed), then the sandbox pool, if the run has one (every sandbox it made goes)."""
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def release(self) -> None:
        """``close``, then the rollout engines' clients and the Ray actors of ``[cluster]``
        (kept up to here for the evaluations after the last step)."""
        self.close()
        if self.cluster is not None:
            self.policy.close()
            try:
                self._write_placement(self.cluster)  # with the sandboxes each host made
            finally:
                self.cluster.close()
                self.cluster = None
