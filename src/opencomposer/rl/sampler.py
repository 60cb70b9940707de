"""Single-epoch task sampler: no task is trained on twice in a run, across restarts too.

Composer trains single-epoch: every prompt is seen once. ``TaskSampler`` fixes a
seeded order of the pool once, hands out tasks in that order, and keeps the ids it
handed out in ``state()`` (saved in every checkpoint); ``TaskSampler.from_state``
resumes after the last task used, so a restarted run never reuses one.

Test: ``pytest tests/unit/rl/test_sampler.py``.
"""

from __future__ import annotations

import random
from pathlib import Path


class PoolExhausted(RuntimeError):
    """The task pool has fewer unused tasks than one step needs."""


class TaskSampler:
    def __init__(self, task_paths: list[Path], per_step: int, seed: int = 0, used: list[str] | None = None):
        names = sorted({Path(p).name: Path(p) for p in task_paths}.items())
        if per_step < 1:
            raise ValueError(f"tasks per step must be >= 1, got {per_step}")
        if len(names) < per_step:
            raise PoolExhausted(
                f"the task pool has {len(names)} tasks but one RL step needs {per_step} "
                "(rollout.tasks_per_step); make more tasks or lower tasks_per_step")
        self.paths = dict(names)
        self.order = [n for n, _ in names]
        random.Random(seed).shuffle(self.order)
        self.per_step, self.seed = per_step, seed
        self.used: list[str] = list(used or [])
        unknown = [u for u in self.used if u not in self.paths]
        if unknown:
            raise ValueError(f"sampler state names tasks not in the pool: {unknown[:3]} (was the task dir changed?)")

    @property
    def remaining(self) -> int:
        return len(self.order) - len(self.used)

    def next_batch(self) -> list[Path]:
        used = set(self.used)
        fresh = [n for n in self.order if n not in used][: self.per_step]
        if len(fresh) < self.per_step:
            raise PoolExhausted(
                f"task pool exhausted: {len(self.used)} of {len(self.order)} tasks used, a step needs "
                f"{self.per_step}; single-epoch RL never reuses a task")
        self.used += fresh
        return [self.paths[n] for n in fresh]

    def state(self) -> dict:
        return {"seed": self.seed, "per_step": self.per_step, "used": list(self.used)}

    @classmethod
    def from_state(cls, task_paths: list[Path], state: dict) -> "TaskSampler":
        return cls(task_paths, state["per_step"], state["seed"], state["used"])
