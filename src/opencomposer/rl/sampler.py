"""Single-epoch task sampler: no task is trained on twice in a run, across restarts too.

Composer trains single-epoch: every prompt is seen once. ``TaskSampler`` fixes a
seeded order of the pool once and hands out tasks in that order. A task handed out is
*in flight* until the trainer has updated on it (``trained``) or gives it back
(``release``: a batch dropped as too stale); ``state()`` (saved in every checkpoint)
keeps only the tasks trained, so a run that stops with batches in flight (collected
ahead of the trainer, ``[rollout] max_staleness``) hands those tasks out again after
``--resume``, and a task trained is never handed out again.

    sampler = TaskSampler(paths, per_step=2, seed=0)
    batch = sampler.issue()        # in flight
    sampler.trained(batch)         # after the optimizer step that used it
    sampler.next_batch()           # both at once (a synchronous step)

Thread-safe: a rollout thread issues while the trainer marks batches trained.

Test: ``pytest tests/unit/rl/test_sampler.py``.
"""

from __future__ import annotations

import random
import threading
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
        self.used: list[str] = list(used or [])  # trained on, in the order trained
        self.in_flight: list[str] = []  # handed out, not trained yet (never saved)
        self._lock = threading.Lock()
        unknown = [u for u in self.used if u not in self.paths]
        if unknown:
            raise ValueError(f"sampler state names tasks not in the pool: {unknown[:3]} (was the task dir changed?)")

    @property
    def remaining(self) -> int:
        """Tasks neither trained on nor in flight."""
        return len(self.order) - len(self.used) - len(self.in_flight)

    def issue(self) -> list[Path]:
        """The next ``per_step`` tasks nobody has: in flight until ``trained`` or ``release``."""
        with self._lock:
            taken = set(self.used) | set(self.in_flight)
            fresh = [n for n in self.order if n not in taken][: self.per_step]
            if len(fresh) < self.per_step:
                raise PoolExhausted(
                    f"task pool exhausted: {len(self.used)} of {len(self.order)} tasks used "
                    f"({len(self.in_flight)} more in flight), a step needs {self.per_step}; "
                    "single-epoch RL never reuses a task")
            self.in_flight += fresh
            return [self.paths[n] for n in fresh]

    def trained(self, paths: list[Path]) -> None:
        """The trainer updated on these tasks: used for good (saved in ``state()``)."""
        with self._lock:
            for name in self._names(paths):
                self.in_flight.remove(name)
                self.used.append(name)

    def release(self, paths: list[Path]) -> None:
        """These tasks were not trained on (their batch was dropped): hand them out again."""
        with self._lock:
            for name in self._names(paths):
                self.in_flight.remove(name)

    def next_batch(self) -> list[Path]:
        """Issue and count as trained at once: a synchronous step, whose checkpoint follows its update."""
        batch = self.issue()
        self.trained(batch)
        return batch

    def extend(self, paths: list[Path]) -> int:
        """Append tasks the sampler does not know yet to the end of its order; returns how many."""
        added = 0
        with self._lock:
            for p in paths:
                if p.name not in self.paths:
                    self.paths[p.name] = p
                    self.order.append(p.name)
                    added += 1
        return added

    def _names(self, paths: list[Path]) -> list[str]:
        names = [Path(p).name for p in paths]
        stray = [n for n in names if n not in self.in_flight]
        if stray:
            raise ValueError(f"tasks {stray[:3]} are not in flight (trained already, or never handed out)")
        return names

    def state(self) -> dict:
        with self._lock:
            return {"seed": self.seed, "per_step": self.per_step, "used": list(self.used)}

    @classmethod
    def from_state(cls, task_paths: list[Path], state: dict) -> "TaskSampler":
        return cls(task_paths, state["per_step"], state["seed"], state["used"])
