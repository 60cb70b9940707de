"""The RL run: tasks -> K rollouts per task -> test rewards -> group advantages -> update.

    opencomposer train --config configs/train/demo.toml [--resume]

Two parts that exchange only a batch and weights: the actor (``rl/actor.py``: tasks,
rollouts, scoring, the rollout engine, the weight store, the metrics log) and the learner
(``rl/learner.py``: the trainer, the loss, checkpoints). One step (``RLRun.step``):

    collect  the actor's next scored batch (rollouts ahead in a thread with ``max_staleness``)
    learn    one optimizer step of the learner on its token samples (``Batch.train``)
    publish  the learner's new weights to the actor: engine (in flight when ahead) and store
    report   the step's metrics row

then ``run`` checkpoints (learner, with the actor's ``state``) and logs the row, in that
order: a kill in between loses nothing, since the row travels in the checkpoint, and
``--resume`` continues exactly where a run stopped (weights, optimizer, task sampler, and the
rollout sampler's seed position: ``SAMPLING_CALLS``, so a synchronous run whose sampling is
reproducible draws after a resume what it would have drawn uninterrupted), on this machine or on
a fresh one from the run's carry set (``pipeline/carry.py``). A checkpoint of another run (model,
task pool, seed, loss or LoRA settings) is refused (``Learner.resume``).

Under torchrun (``torchrun --nproc-per-node N -m opencomposer.cli train --config C``) every
rank has a learner, sharded (FSDP2, ``train/distributed.py``), and rank 0 alone an actor
(``distributed.main_only``; the others an ``Absent`` stand-in on which each actor call does
nothing). The actor's batch, or its error, reaches every rank (``distributed.on_main``);
every rank trains on its share; then all gather the new weights to rank 0 (one collective
a version), where the engine, the weight store and the evaluations read them. Logs and
metrics are rank 0's. ``rollout.engine = "hf"`` samples with the trainer's own model, which
no single rank holds, so it is refused there.

Test: ``pytest tests/integration/test_rl_run.py tests/integration/test_async_rl.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opencomposer.config import ConfigError
from opencomposer.policies.fanout import FanoutPolicy
from opencomposer.rl.actor import Actor, sandbox_pool  # noqa: F401 (sandbox_pool: tests/unit/sandbox/test_pool.py)
from opencomposer.rl.config import RLRunConfig
from opencomposer.rl.learner import Learner
from opencomposer.train import distributed
from opencomposer.train.update_profile import profiled

# the key of a checkpoint's actor state that holds how many sampling calls the rollout policy made:
# its seed for call n is seed + n (policies/model.py, engine.py, server.py), so a resumed run
# continues the count instead of drawing step 1's seeds again
SAMPLING_CALLS = "sampling_calls"


def _seeded(policy: Any) -> list[Any]:
    """The policies whose call counters seed sampling: a BatchedPolicy's wrapped one (each
    engine's, over several: ``FanoutPolicy``); [] when none has a counter."""
    batched = policy.engines() if isinstance(policy, FanoutPolicy) else [policy]
    inner = [getattr(b, "policy", None) for b in batched]
    return [p for p in inner if isinstance(getattr(p, "_calls", None), int)]


def sampling_state(policy: Any) -> dict[str, int]:
    """``{SAMPLING_CALLS: n}`` of the actor's rollout policy (several engines: the most calls
    any made); {} when it has no counter."""
    inner = _seeded(policy)
    return {SAMPLING_CALLS: max(p._calls for p in inner)} if inner else {}


def restore_sampling(policy: Any, state: dict) -> None:
    """Continue the rollout policy's seed count where the checkpoint's run left it (several
    engines: each from the most any made, so none draws a seed again)."""
    if SAMPLING_CALLS in state:
        for inner in _seeded(policy):
            inner._calls = int(state[SAMPLING_CALLS])


def refuse_unsharded_engine(cfg: RLRunConfig, dist: distributed.Dist) -> None:
    """Under torchrun, ``rollout.engine = "hf"`` is refused (checked before any stage trains)."""
    if dist.enabled and cfg.rollout.engine == "hf":
        raise ConfigError("rollout.engine='hf' samples with the trainer's own model, which torchrun shards "
                          "over the ranks: use rollout.engine='builtin' (rank 0's engine) or 'server'")


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
    # the pool the run's checkpoints were written with, when it has grown since (every task of it still in
    # train_tasks): the checkpoint resumes (Learner.resume_note); None: the pool must be the checkpoint's
    grown_from: list[Path] | None = None
    learner: Learner = field(init=False)
    actor: Actor = field(init=False)

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.dist = distributed.init_from_env(self.cfg.model.device)  # a plain process unless started by torchrun
        device = str(distributed.rank_device(self.dist, self.cfg.model.device))
        refuse_unsharded_engine(self.cfg, self.dist)
        self.start_model = self.start_model or self.cfg.model.name
        self.learner = Learner(self.cfg, self.out, self.start_model, self.dist, device,
                               task_ids=[Path(p).name for p in self.train_tasks],  # the sampler's ids
                               grown_from=None if self.grown_from is None else [Path(p).name for p in self.grown_from])
        self.start_step, state = self.learner.resume() if self.resume else (0, {})
        weights = self.learner.weights()  # sharded: a collective, so outside main_only
        self.actor = distributed.main_only(self.dist, lambda: Actor(
            self.cfg, self.train_tasks, self.out, self.learner.trainer.tokenizer, weights, device, self.start_model,
            self.on_step, self.start_step, state))
        distributed.main_does(self.dist, lambda: restore_sampling(self.actor.policy, state))

    def step(self, step: int) -> dict[str, Any] | None:
        """One RL step; its metrics row (None on ranks other than 0)."""
        batch = distributed.on_main(self.dist, self.actor.next_batch, "rank 0 stopped the run while collecting rollouts")
        profile = distributed.main_does(self.dist, lambda: step + 1 in self.cfg.run.profile_steps)  # rank 0's
        with profiled(self.out / "profile" / f"step-{step + 1:04d}.txt") if profile else nullcontext():
            t0, cpu0 = time.perf_counter(), time.thread_time()
            metrics = self.learner.update(batch.train)
            t1 = time.perf_counter()
            weights = self.learner.weights()
        # where the trainer's time goes: the update, the weights gathered for the actor, and how much of
        # it this thread ran (a CUDA wait spins, so it counts; the GIL held by the rollouts' threads does not)
        metrics.update(time_update=t1 - t0, time_weights=time.perf_counter() - t1,
                       time_train_cpu=time.thread_time() - cpu0)
        published = self.actor.publish(weights, batch)
        return self.actor.report(step + 1, batch, metrics, published)

    def run(self) -> list[dict]:
        """Every step from ``start_step`` to ``[run] steps``; the rows logged (rank 0's)."""
        self.reference()  # the KL reference, loaded before the first rollout
        try:
            self.actor.start(self.cfg.run.steps - self.start_step)
            for step in range(self.start_step, self.cfg.run.steps):
                row = self.step(step)
                self.learner.save(step + 1, self.actor_state(row))  # checkpoint first (atomic), then the row
                self.actor.log(row)
        finally:
            self.close()
        return self.actor.logged() or []

    # ------------------------------------------------------------------ for the pipeline (pipeline/run.py)

    def actor_state(self, row: dict | None) -> dict | None:
        """What a checkpoint keeps of the actor (``Actor.state``) and of its sampling position;
        None on ranks other than 0."""
        return distributed.main_does(self.dist, lambda: {**self.actor.state(row), **sampling_state(self.actor.policy)})

    def refresh_weights(self) -> None:
        """The learner's weights to the actor after the trainer moved outside ``step`` (SFT).
        Sharded: a collective, every rank calls it."""
        self.actor.take(self.learner.weights())

    def reference(self):
        return self.learner.reference()

    def close(self) -> None:
        """The rollout thread and sandbox pool (the run's end); the cluster stays for evaluations."""
        self.actor.close()

    def release(self) -> None:
        """All the actor holds, the Ray actors of ``[cluster]`` included (rank 0; no-op elsewhere)."""
        distributed.main_does(self.dist, self.actor.release)
