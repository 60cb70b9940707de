"""The task pool of a run: make tasks from the configured sources if needed, split held-out.

The split is drawn once from ``tasks.seed`` and written to ``<out>/split.json``; a
resumed run reads it back, so held-out tasks never leak into training. The two sides never
share a task id or a deleted symbol of the same library version (``split_key``: the tasks
that delete ``f`` at block, body and function level go to one side together); a split.json
that breaks this is refused naming both tasks (``check_disjoint``).

Difficulty on demand (``HarderTasks``, on when ``[tasks] factory`` and ``harder_every`` are
set): every ``harder_every`` steps the run reports its rolling pass@1 (the last
``pass_window`` steps) to the task factory (``TaskFactory.harder``); when the factory's level
schedule moves (up at ``[difficulty] raise_at`` of the factory config, down below
``lower_at``), it makes a new batch at the new levels into ``<out>/factory_tasks`` and those
tasks join the training pool (never the held-out split, and never one that deletes a
held-out task's symbol: those are left out). The factory runs in the training loop: keep
its ``max_per_library`` small.

The run's sampler (``task_sampler``): ``[tasks] sampling`` picks uniform or informative draws
(``rl/sampler.py``), strata by ``task_stratum`` (task.toml ``feature.level``, and the library
with ``strata = ["level", "library"]``). The two compose: ``HarderTasks`` extends the pool
(``TaskSampler.extend``), the sampler decides what to draw; a new level is a new stratum, at the
prior's estimate (the target), so informative sampling tries the new tasks soon, while uniform
sampling reaches them once the earlier pool is used.

Test: ``.venv/bin/python -m pytest tests/unit/tasks/test_harder_rl.py tests/unit/rl/test_split.py
tests/unit/rl/test_informative.py``.
"""

from __future__ import annotations

import json
import random
import tomllib
from functools import partial
from pathlib import Path

from opencomposer.paths import atomic_write_text
from opencomposer.rl.config import TasksSection
from opencomposer.rl.sampler import Informative, TaskSampler
from opencomposer.tasks.format import SourceInfo, Task, TaskFormatError, TaskMeta, find_tasks

SPLIT_FILE = "split.json"


def ensure_tasks(cfg: TasksSection, backend: str, log=print) -> list[Path]:
    root = Path(cfg.dir)
    have = find_tasks([root]) if root.is_dir() else []
    have = [p for p in have if (p / "task.toml").exists()]
    if not have and cfg.sources:
        from opencomposer.grading.check import staged_check
        from opencomposer.tasks.make import make_tasks
        for src in cfg.sources:
            log(f"making tasks from {src} ...")
            rep = make_tasks(src, root, cfg.max_per_source, cfg.seed, backend, tuple(cfg.levels),
                             check=staged_check(backend))
            log(f"  {len(rep.made)} tasks in {rep.seconds['total']}s")
        have = [p for p in find_tasks([root]) if (p / "task.toml").exists()]
    if not have:
        raise FileNotFoundError(f"{root}: no tasks there and no [tasks] sources to make them from")
    return sorted(have)


def task_stratum(path: Path, by: tuple[str, ...] | list[str] = ("level",)) -> str:
    """The stratum of a task for informative sampling: its ``feature.level`` and/or its library
    (``source.package``, else the name in ``source.spec``), joined by ``/``: "body", "body/toolz"."""
    toml = Path(path) / "task.toml"
    try:
        data = tomllib.loads(toml.read_text())
        parts = {"level": str(data["feature"]["level"]),
                 "library": str(data["source"].get("package") or SourceInfo(spec=str(data["source"]["spec"])).name)}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, KeyError, TypeError) as e:
        raise TaskFormatError(f"{toml}: cannot read feature.level and source.spec for informative sampling: "
                              f"{type(e).__name__}: {e}") from None
    return "/".join(parts[k] for k in by)


def task_sampler(cfg: TasksSection, paths: list[Path], per_step: int, seed: int,
                 state: dict | None = None) -> TaskSampler:
    """The run's ``TaskSampler`` as ``[tasks] sampling`` asks (from a checkpoint's ``state`` on resume)."""
    informative = stratum = None
    if cfg.sampling == "informative":
        informative = Informative(target=cfg.target_pass_rate, explore=cfg.explore, temperature=cfg.temperature,
                                  prior_strength=cfg.prior_strength, decay=cfg.estimate_decay)
        stratum = partial(task_stratum, by=tuple(cfg.strata))
    if state:
        return TaskSampler.from_state(paths, state, stratum=stratum, informative=informative)
    return TaskSampler(paths, per_step, seed, stratum=stratum, informative=informative)


def split_key(meta: TaskMeta) -> tuple[str, str, str] | None:
    """What a task gives away to a model trained on it: the deleted symbol of one library
    version, as (source spec, file, symbol); None where the task names no symbol."""
    if not meta.feature.symbol:
        return None
    return (f"{meta.source.kind}:{meta.source.spec}", meta.feature.file, meta.feature.symbol)


def _metas(paths: list[Path], where: str) -> dict[Path, TaskMeta]:
    out = {}
    for p in paths:
        try:
            out[p] = Task.load(p).meta
        except TaskFormatError as e:
            raise ValueError(f"{where}: {e}") from None
    return out


def check_disjoint(train: list[Path], held: list[Path], where: str,
                   metas: dict[Path, TaskMeta] | None = None) -> None:
    """Raise ValueError naming both tasks if a training and a held-out task share a task id
    or a deleted symbol of the same library version (``split_key``)."""
    metas = metas or _metas(train + held, where)
    seen: dict[object, Path] = {}
    for p in held:
        seen[("id", metas[p].id)] = p
        if (k := split_key(metas[p])) is not None:
            seen[("symbol", k)] = p
    for p in train:
        for what, key in (("id", metas[p].id), ("symbol", split_key(metas[p]))):
            other = seen.get((what, key)) if key is not None else None
            if other is not None:
                shared = (f"the task id {key!r}" if what == "id" else
                          f"the deleted symbol {key[2]!r} of {key[1]} in {key[0]}")
                raise ValueError(f"{where}: training task {p} and held-out task {other} share {shared}; "
                                 "expected held-out tasks to share neither id nor deleted symbol with training")


def _groups(paths: list[Path], metas: dict[Path, TaskMeta]) -> list[list[Path]]:
    """Tasks joined when they share an id or a ``split_key``: each group goes to one side."""
    parent = {p: p for p in paths}

    def find(p: Path) -> Path:
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    first: dict[object, Path] = {}
    for p in paths:
        for key in (("id", metas[p].id), ("symbol", split_key(metas[p]))):
            if key[1] is None:
                continue
            if key in first:
                parent[find(p)] = find(first[key])
            else:
                first[key] = p
    groups: dict[Path, list[Path]] = {}
    for p in paths:
        groups.setdefault(find(p), []).append(p)
    return sorted(groups.values(), key=lambda g: g[0].name)


def split_tasks(tasks: list[Path], heldout: int, seed: int, out: Path) -> tuple[list[Path], list[Path]]:
    """(train, heldout); stable across restarts through ``out/split.json``; the sides share no
    task id and no deleted symbol (``check_disjoint``), whether drawn now or read back."""
    path = out / SPLIT_FILE
    by_name = {p.name: p for p in tasks}
    metas = _metas(sorted(by_name.values()), str(path))
    if path.exists():
        saved = json.loads(path.read_text())
        missing = [n for n in saved["heldout"] + saved["train"] if n not in by_name]
        if missing:
            raise ValueError(f"{path}: names tasks missing from the pool: {missing[:3]}")
        train, held = [by_name[n] for n in saved["train"]], [by_name[n] for n in saved["heldout"]]
        check_disjoint(train, held, str(path), metas)
        return train, held
    names = sorted(by_name)
    if heldout >= len(names):
        raise ValueError(f"tasks.heldout = {heldout} but the pool has only {len(names)} tasks")
    groups = _groups([by_name[n] for n in names], metas)
    random.Random(seed).shuffle(groups)
    held_paths: list[Path] = []
    for g in groups:  # whole groups, as many as fit in ``heldout``
        if len(held_paths) + len(g) <= heldout:
            held_paths += g
    if heldout and not held_paths:
        raise ValueError(f"tasks.heldout = {heldout}: every group of tasks that share a deleted symbol is "
                         f"larger (smallest: {min(len(g) for g in groups)}); raise tasks.heldout")
    held = sorted(p.name for p in held_paths)
    train = [n for n in names if n not in held]
    check_disjoint([by_name[n] for n in train], [by_name[n] for n in held], str(path), metas)
    out.mkdir(parents=True, exist_ok=True)
    held_ids = sorted({metas[by_name[n]].id for n in held})
    symbols = sorted({k for n in held if (k := split_key(metas[by_name[n]])) is not None})
    atomic_write_text(path, json.dumps({"train": train, "heldout": held, "heldout_ids": held_ids,
                                        "heldout_symbols": [list(k) for k in symbols]}, indent=1))
    return [by_name[n] for n in train], [by_name[n] for n in held]


def without_heldout(paths: list[Path], out: Path) -> list[Path]:
    """``paths`` less those sharing an id or a deleted symbol with a held-out task of the run
    at ``out`` (its split.json); all of them when there is no split yet."""
    split = out / SPLIT_FILE
    if not split.exists() or not paths:
        return list(paths)
    saved = json.loads(split.read_text())
    ids = set(saved.get("heldout_ids", saved["heldout"]))  # a split.json from before: names are ids
    keys = {tuple(k) for k in saved.get("heldout_symbols", [])}
    metas = _metas(list(paths), str(split))
    return [p for p in paths if metas[p].id not in ids and split_key(metas[p]) not in keys]


class HarderTasks:
    """The trainer's side of the factory's difficulty schedule (module docstring)."""

    def __init__(self, cfg: TasksSection, out: Path, log=print):
        from opencomposer.config import load_config
        from opencomposer.grading.check import staged_check
        from opencomposer.tasks.factory import FactoryConfig, TaskFactory

        if not cfg.factory:
            raise ValueError("HarderTasks needs tasks.factory (a factory config file)")
        fcfg = load_config(Path(cfg.factory), FactoryConfig)
        self.factory = TaskFactory(fcfg, Path(out) / "factory_tasks", check=staged_check(fcfg.factory.backend))
        self.run_out = Path(out)  # its split.json names what must stay held out
        self.every, self.window, self.log = cfg.harder_every, cfg.pass_window, log
        self.rates: list[float] = []

    def made_tasks(self) -> list[Path]:
        """Every task the factory made for this run so far (all sessions), less any that would
        teach a held-out task's symbol (``without_heldout``)."""
        root = self.factory.out
        made = sorted(p for p in find_tasks([root]) if (p / "task.toml").exists()) if root.is_dir() else []
        return without_heldout(made, self.run_out)

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

