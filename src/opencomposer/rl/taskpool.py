"""The task pool of a run: make tasks from the configured sources if needed, split held-out.

The split is drawn once from ``tasks.seed`` and written to ``<out>/split.json``; a
resumed run reads it back, so held-out tasks never leak into training.

Difficulty on demand (``HarderTasks``, on when ``[tasks] factory`` and ``harder_every`` are
set): every ``harder_every`` steps the run reports its rolling pass@1 (the last
``pass_window`` steps) to the task factory (``TaskFactory.harder``); when the factory's level
schedule moves (up at ``[difficulty] raise_at`` of the factory config, down below
``lower_at``), it makes a new batch at the new levels into ``<out>/factory_tasks`` and those
tasks join the training pool (never the held-out split). The factory runs in the training
loop: keep its ``max_per_library`` small.

Test: ``.venv/bin/python -m pytest tests/unit/tasks_factory/test_harder_rl.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from opencomposer.paths import atomic_write_text
from opencomposer.rl.config import TasksSection
from opencomposer.rl.sampler import TaskSampler
from opencomposer.tasks.format import find_tasks


def ensure_tasks(cfg: TasksSection, backend: str, log=print) -> list[Path]:
    root = Path(cfg.dir)
    have = find_tasks([root]) if root.is_dir() else []
    have = [p for p in have if (p / "task.toml").exists()]
    if not have and cfg.sources:
        from opencomposer.tasks.make import make_tasks
        for src in cfg.sources:
            log(f"making tasks from {src} ...")
            rep = make_tasks(src, root, cfg.max_per_source, cfg.seed, backend, tuple(cfg.levels))
            log(f"  {len(rep.made)} tasks in {rep.seconds['total']}s")
        have = [p for p in find_tasks([root]) if (p / "task.toml").exists()]
    if not have:
        raise FileNotFoundError(f"{root}: no tasks there and no [tasks] sources to make them from")
    return sorted(have)


def split_tasks(tasks: list[Path], heldout: int, seed: int, out: Path) -> tuple[list[Path], list[Path]]:
    """(train, heldout); stable across restarts through ``out/split.json``."""
    path = out / "split.json"
    by_name = {p.name: p for p in tasks}
    if path.exists():
        saved = json.loads(path.read_text())
        missing = [n for n in saved["heldout"] + saved["train"] if n not in by_name]
        if missing:
            raise ValueError(f"{path}: names tasks missing from the pool: {missing[:3]}")
        return [by_name[n] for n in saved["train"]], [by_name[n] for n in saved["heldout"]]
    names = sorted(by_name)
    if heldout >= len(names):
        raise ValueError(f"tasks.heldout = {heldout} but the pool has only {len(names)} tasks")
    held = sorted(random.Random(seed).sample(names, heldout))
    train = [n for n in names if n not in held]
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"train": train, "heldout": held}, indent=1))
    return [by_name[n] for n in train], [by_name[n] for n in held]


class HarderTasks:
    """The trainer's side of the factory's difficulty schedule (module docstring)."""

    def __init__(self, cfg: TasksSection, out: Path, log=print):
        from opencomposer.config import load_config
        from opencomposer.tasks.factory import FactoryConfig, TaskFactory

        if not cfg.factory:
            raise ValueError("HarderTasks needs tasks.factory (a factory config file)")
        self.factory = TaskFactory(load_config(Path(cfg.factory), FactoryConfig), Path(out) / "factory_tasks")
        self.every, self.window, self.log = cfg.harder_every, cfg.pass_window, log
        self.rates: list[float] = []

    def made_tasks(self) -> list[Path]:
        """Every task the factory made for this run so far (all sessions)."""
        root = self.factory.out
        return sorted(p for p in find_tasks([root]) if (p / "task.toml").exists()) if root.is_dir() else []

    def after_step(self, step: int, pass_rate: float, sampler: TaskSampler) -> dict[str, float]:
        """Record step ``step``'s (1-based) pass@1; on a reporting step, ask the factory and add
        what it makes to ``sampler``. Returns metrics for the step's row."""
        self.rates = (self.rates + [float(pass_rate)])[-self.window:]
        row = {"tasks_level_position": self.factory.schedule.position, "tasks_added": 0.0}
        if self.every <= 0 or step % self.every:
            return row
        rate = sum(self.rates) / len(self.rates)
        before = self.factory.schedule.position
        weights = self.factory.harder(rate)
        row["tasks_level_position"] = self.factory.schedule.position
        if self.factory.schedule.position == before:
            return row
        self.log(f"rolling pass@1 {rate:.2f}: task levels {before} -> {self.factory.schedule.position} "
                 f"({weights}); asking the factory for a batch ...")
        had = set(self.made_tasks())
        rep = self.factory.make()
        new = [p for p in self.made_tasks() if p not in had]
        added = sampler.extend(new)
        self.log(f"  {len(new)} new tasks ({rep.summary()['levels']}), {added} added to the pool")
        row["tasks_added"] = float(added)
        return row

    def state(self) -> dict:
        return {"position": self.factory.schedule.position, "rounds": self.factory.rounds, "rates": list(self.rates)}

    def restore(self, state: dict) -> None:
        self.factory.schedule.position = float(state["position"])
        self.factory.rounds = int(state["rounds"])
        self.rates = [float(r) for r in state["rates"]][-self.window:]

