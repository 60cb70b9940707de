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

Which unused task comes next (``[tasks] sampling``): "uniform" (the default) takes them in
the seeded order. "informative" (``Informative``) keeps an online estimate of the pass rate of
each *stratum* of tasks (their level, and optionally their library: ``stratum``, e.g.
``taskpool.task_stratum``) from the groups trained on (``trained(paths, results)``): a Beta
posterior whose prior has mean ``target`` and weight ``prior_strength`` rollouts, and whose
evidence is multiplied by ``decay`` before each update of the stratum (an exponential moving
average that follows the policy as it improves). Each draw picks a stratum with probability
``(1 - explore) * softmax(-|p_s - target| / temperature) + explore / strata`` (strata with an
unused task only), then that stratum's next task in the seeded order: groups near a
``target`` pass rate (0.5: the most informative) come first, an untried stratum (prior mean
``target``) is tried early, and no stratum starves. Draw j of the run uses
``random.Random(f"{seed}:{j}")``, j the number of tasks trained or in flight, so the draws are a
function of ``state()`` (which saves the estimates): a resumed run draws what an
uninterrupted one would.

    sampler = TaskSampler(paths, 2, seed=0, stratum=task_stratum, informative=Informative())
    batch = sampler.issue()
    sampler.trained(batch, {p.name: [1.0, 0.0, 1.0, 1.0] for p in batch})  # the K task rewards

Test: ``pytest tests/unit/rl/test_sampler.py tests/unit/rl/test_informative.py``.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PASS = 1.0  # a rollout passes when its task reward reaches this (as pass@1 counts, rl/metrics.py)


class PoolExhausted(RuntimeError):
    """The task pool has fewer unused tasks than one step needs."""


@dataclass(frozen=True)
class Informative:
    """The settings of difficulty-aware sampling (module docstring; ``[tasks]`` keys of the same names)."""

    target: float = 0.5  # the pass rate preferred (tasks.target_pass_rate)
    explore: float = 0.1  # share of draws spread evenly over the strata
    temperature: float = 0.1  # of the softmax over -|estimate - target|: lower is greedier
    prior_strength: float = 2.0  # rollouts' worth of prior at pass rate ``target``
    decay: float = 0.9  # evidence kept at each update of a stratum (1.0: a plain Beta posterior)

    def __post_init__(self) -> None:
        if not (0 < self.target < 1 and 0 <= self.explore <= 1 and self.temperature > 0
                and self.prior_strength > 0 and 0 < self.decay <= 1):
            raise ValueError(f"informative sampling needs 0 < target < 1, 0 <= explore <= 1, temperature > 0, "
                             f"prior_strength > 0, 0 < decay <= 1; got {self}")


class TaskSampler:
    def __init__(self, task_paths: list[Path], per_step: int, seed: int = 0, used: list[str] | None = None,
                 stratum: Callable[[Path], str] | None = None, informative: Informative | None = None,
                 estimates: Mapping[str, Sequence[float]] | None = None):
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
        if informative is not None and stratum is None:
            raise ValueError("informative sampling needs a stratum function (task path -> level, library)")
        self.informative, self._stratum = informative, stratum
        self._strata: dict[str, str] = {}  # task name -> stratum, read when first needed
        # stratum -> [passes, fails] seen (decayed); the prior is added when estimating
        self.evidence: dict[str, list[float]] = {k: [float(a), float(b)] for k, (a, b) in (estimates or {}).items()}

    @property
    def remaining(self) -> int:
        """Tasks neither trained on nor in flight."""
        return len(self.order) - len(self.used) - len(self.in_flight)

    def issue(self, n: int | None = None, allow_fewer: bool = False) -> list[Path]:
        """The next ``n`` (default ``per_step``) tasks nobody has: in flight until ``trained`` or
        ``release``. Fewer than ``n`` left: ``PoolExhausted``, or (``allow_fewer``) what is left."""
        n = self.per_step if n is None else n
        with self._lock:
            taken = set(self.used) | set(self.in_flight)
            free = [x for x in self.order if x not in taken]
            if len(free) < n and not allow_fewer:
                raise PoolExhausted(
                    f"task pool exhausted: {len(self.used)} of {len(self.order)} tasks used "
                    f"({len(self.in_flight)} more in flight), a step needs {n}; "
                    "single-epoch RL never reuses a task")
            fresh = free[:n] if self.informative is None else self._draw(free, n)
            self.in_flight += fresh
            return [self.paths[x] for x in fresh]

    def trained(self, paths: list[Path], results: Mapping[str, Sequence[float]] | None = None) -> None:
        """The trainer updated on these tasks: used for good (saved in ``state()``). ``results``
        (task name -> its K task rewards) update the pass-rate estimates of informative sampling;
        a task whose group was left out of the update (all passed or all failed) is used all the same."""
        with self._lock:
            for name in self._names(paths):
                self.in_flight.remove(name)
                self.used.append(name)
            if self.informative is not None and results:
                self._observe({Path(p).name: results[Path(p).name] for p in paths if Path(p).name in results})

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

    # ------------------------------------------------------------------ informative sampling

    def stratum_of(self, name: str) -> str:
        if name not in self._strata:
            self._strata[name] = self._stratum(self.paths[name])
        return self._strata[name]

    def estimate(self, stratum: str) -> float:
        """The estimated pass rate of a stratum: the Beta posterior mean (the prior's: ``target``)."""
        inf = self.informative
        passes, fails = self.evidence.get(stratum, (0.0, 0.0))
        return (inf.prior_strength * inf.target + passes) / (inf.prior_strength + passes + fails)

    def weights(self, strata: Sequence[str]) -> list[float]:
        """The probability of drawing from each of ``strata`` (module docstring)."""
        inf = self.informative
        logits = [-abs(self.estimate(k) - inf.target) / inf.temperature for k in strata]
        top = max(logits)
        soft = [math.exp(v - top) for v in logits]
        total = sum(soft)
        return [(1 - inf.explore) * w / total + inf.explore / len(strata) for w in soft]

    def _draw(self, free: list[str], n: int) -> list[str]:
        """``n`` of the ``free`` tasks (in the seeded order), each from a stratum drawn by ``weights``."""
        by: dict[str, list[str]] = {}
        for name in free:
            by.setdefault(self.stratum_of(name), []).append(name)
        start = len(self.used) + len(self.in_flight)  # draws so far: the same after a resume
        picks: list[str] = []
        for j in range(n):
            if not by:
                break
            strata = sorted(by)
            key = random.Random(f"{self.seed}:{start + j}").choices(strata, self.weights(strata))[0]
            picks.append(by[key].pop(0))
            if not by[key]:
                del by[key]
        return picks

    def _observe(self, results: Mapping[str, Sequence[float]]) -> None:
        seen: dict[str, list[float]] = {}
        for name, rewards in results.items():
            c = seen.setdefault(self.stratum_of(name), [0.0, 0.0])
            passed = sum(float(r) >= PASS for r in rewards)
            c[0] += passed
            c[1] += len(rewards) - passed
        d = self.informative.decay
        for key, (passes, fails) in seen.items():
            a, b = self.evidence.get(key, (0.0, 0.0))
            self.evidence[key] = [d * a + passes, d * b + fails]

    def observe(self, results: Mapping[str, Sequence[float]]) -> None:
        """Update the estimates with groups' task rewards (task name -> K rewards); ``trained`` does
        this for the tasks it marks."""
        if self.informative is None:
            return
        with self._lock:
            self._observe(results)

    def metrics(self) -> dict[str, float]:
        """The estimated pass rate of every stratum seen so far (``pass_est_<stratum>``); {} when uniform."""
        if self.informative is None:
            return {}
        with self._lock:
            return {f"pass_est_{k}": round(self.estimate(k), 4) for k in sorted(self.evidence)}

    def state(self) -> dict:
        with self._lock:
            out = {"seed": self.seed, "per_step": self.per_step, "used": list(self.used)}
            if self.informative is not None:
                out["estimates"] = {k: list(v) for k, v in sorted(self.evidence.items())}
            return out

    @classmethod
    def from_state(cls, task_paths: list[Path], state: dict, stratum: Callable[[Path], str] | None = None,
                   informative: Informative | None = None) -> TaskSampler:
        """The sampler ``state()`` saved; its estimates are kept when ``informative`` (a uniform
        run resumed as informative starts from the prior)."""
        return cls(task_paths, state["per_step"], state["seed"], state["used"], stratum=stratum,
                   informative=informative, estimates=state.get("estimates"))
