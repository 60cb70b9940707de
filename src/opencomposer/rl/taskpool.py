"""The task pool of a run: make tasks from the configured sources if needed, split held-out.

The split is drawn once from ``tasks.seed`` and written to ``<out>/split.json``; a
resumed run reads it back, so held-out tasks never leak into training.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from opencomposer.paths import atomic_write_text
from opencomposer.rl.config import TasksSection
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
