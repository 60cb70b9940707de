"""Eval suites: a named, fixed list of tasks with a difficulty label each, from a TOML file.

    suite = load_suite("smoke")           # configs/suites/smoke.toml
    suite = load_suite("my-suite.toml")   # any suite file
    suite = load_suite("out/tasks")       # a directory of task dirs (or one task dir)
    suite.name, len(suite.tasks), suite.difficulty["<task id>"]

A suite file lists sources; relative paths are relative to the suite file::

    name = "heldout-40"                      # optional; default the file's stem
    description = "..."
    [[source]]
    kind = "dir"                             # task dirs: a task dir, a dir of them, or a glob
    path = "../../out/tasks"
    limit = 40                               # optional: a seeded sample, even across difficulties
    seed = 0
    env = "task"                             # "current": tasks with no env (and imports) use
                                             # this interpreter's environment
    [[source]]
    kind = "humaneval"                       # the first `limit` problems (or `ids`), imported once
    limit = 20                               # into the cache (or `cache = "dir"`)
    difficulty = "humaneval"                 # label for every task of the source
    [[source]]
    kind = "harbor"                          # Harbor task dirs, imported once into the cache
    path = "harbor-tasks/"
    [[source]]
    kind = "swebench"                        # SWE-bench JSONL + local clones, imported once
    path = "swe.jsonl"
    repos = "clones/"

A task's difficulty is the source's ``difficulty`` when given, else the deletion level the
task factory wrote (``task.toml`` ``feature.level``: line < block < body < function < class < feature).

Test: ``pytest tests/unit/eval/test_suite.py``.
"""

from __future__ import annotations

import glob
import hashlib
import random
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from opencomposer.config import ConfigError, Strict, load_config
from opencomposer.paths import cache_dir
from opencomposer.tasks.format import Task, TaskFormatError, task_dirs

SUITES_DIR = Path(__file__).resolve().parents[3] / "configs" / "suites"


class SuiteError(ValueError):
    """A suite that cannot be loaded; the message names the suite, file or field."""


class SourceSpec(Strict):
    kind: Literal["dir", "humaneval", "harbor", "swebench"]
    path: str = Field("", description="dir/harbor: tasks; swebench: the JSONL file")
    repos: str = Field("", description="swebench: directory of local clones")
    ids: list[int] = Field(default_factory=list, description="humaneval: problem numbers")
    limit: int = Field(0, ge=0, description="0 = all; else a seeded sample (humaneval: the first N)")
    seed: int = 0
    difficulty: str = Field("", description="label for every task of this source (default: feature.level)")
    env: Literal["task", "current"] = "task"
    cache: str = Field("", description="import destination (default: the opencomposer cache)")

    @model_validator(mode="after")
    def _needs(self) -> SourceSpec:
        if self.kind in ("dir", "harbor", "swebench") and not self.path:
            raise ValueError(f"kind={self.kind!r} needs 'path'")
        if self.kind == "swebench" and not self.repos:
            raise ValueError("kind='swebench' needs 'repos' (a directory of local clones)")
        return self


class SuiteFile(Strict):
    name: str = ""
    description: str = ""
    source: list[SourceSpec] = Field(..., min_length=1)


@dataclass
class Suite:
    name: str
    tasks: list[Task]
    difficulty: dict[str, str] = field(default_factory=dict)
    description: str = ""
    origin: str = ""  # the file or directory it came from

    def levels(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for t in self.tasks:
            counts[self.difficulty[t.id]] += 1
        return dict(sorted(counts.items()))


def known_suites() -> list[str]:
    return sorted({p.stem for d in _suite_dirs() for p in d.glob("*.toml")})


def _suite_dirs() -> list[Path]:
    dirs = [Path.cwd() / "configs" / "suites", SUITES_DIR]
    return [d for i, d in enumerate(dirs) if d.is_dir() and d.resolve() not in {x.resolve() for x in dirs[:i]}]


def load_suite(name_or_path: str | Path) -> Suite:
    """A suite by name (``configs/suites/<name>.toml``), suite file, or directory of tasks."""
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.is_file():
        if not p.is_file():
            raise SuiteError(f"suite file {p} does not exist")
        return _from_file(p)
    if p.is_dir():
        tasks = _dir_tasks(p, str(p))
        return Suite(name=p.resolve().name, tasks=tasks, difficulty={t.id: t.meta.feature.level for t in tasks},
                     origin=str(p))
    for d in _suite_dirs():
        f = d / f"{name_or_path}.toml"
        if f.is_file():
            return _from_file(f)
    raise SuiteError(f"unknown suite {str(name_or_path)!r}: not a suite name, a .toml file or a directory "
                     f"(known suites: {', '.join(known_suites()) or 'none'})")


def _from_file(path: Path) -> Suite:
    try:
        spec = load_config(path, SuiteFile)
    except ConfigError as e:
        raise SuiteError(str(e)) from None
    tasks: list[Task] = []
    difficulty: dict[str, str] = {}
    for i, src in enumerate(spec.source):
        where = f"{path}: source[{i}] (kind={src.kind!r})"
        for t in _source_tasks(src, path.parent, where):
            if t.id in difficulty:
                raise SuiteError(f"{where}: task {t.id!r} is already in the suite (from {t.root})")
            if src.env == "current" and not t.meta.environment.env:
                t.meta.environment.env = sys.prefix  # absolute, so Task.env_dir resolves to it
            difficulty[t.id] = src.difficulty or t.meta.feature.level
            tasks.append(t)
    if not tasks:
        raise SuiteError(f"{path}: the suite has no tasks")
    return Suite(name=spec.name or path.stem, tasks=tasks, difficulty=difficulty,
                 description=spec.description, origin=str(path))


def _source_tasks(src: SourceSpec, base: Path, where: str) -> list[Task]:
    if src.kind == "dir":
        pattern = str(base / src.path)
        roots = sorted(Path(p) for p in glob.glob(pattern)) if glob.has_magic(pattern) else [Path(pattern)]
        if not roots:
            raise SuiteError(f"{where}: path {src.path!r} matches nothing under {base}")
        tasks = [t for r in roots for t in _dir_tasks(r, where)]
    elif src.kind == "humaneval":
        tasks = _humaneval(src, base, where)
    else:
        tasks = _imported(src, base, where)
    return _sample(tasks, src) if src.limit and src.kind != "humaneval" else tasks


def _dir_tasks(root: Path, where: str) -> list[Task]:
    """``root`` itself when it is a task dir, else every task dir directly under it."""
    if not root.is_dir():
        raise SuiteError(f"{where}: {root} is not a directory")
    if (root / "task.toml").is_file():
        return [_load(root, where)]
    tasks = [_load(d, where) for d in task_dirs(root)]
    if not tasks:
        raise SuiteError(f"{where}: {root} holds no task directories (none has a task.toml)")
    return tasks


def _load(d: Path, where: str) -> Task:
    try:
        return Task.load(d)
    except TaskFormatError as e:
        raise SuiteError(f"{where}: {e}") from None


def _sample(tasks: list[Task], src: SourceSpec) -> list[Task]:
    """``src.limit`` tasks, seeded, taken round-robin across difficulty levels so a rare
    level is not crowded out; returned in id order."""
    by_level: dict[str, list[Task]] = defaultdict(list)
    for t in sorted(tasks, key=lambda t: t.id):
        by_level[src.difficulty or t.meta.feature.level].append(t)
    rng = random.Random(src.seed)
    for lst in by_level.values():
        rng.shuffle(lst)
    picked: list[Task] = []
    while len(picked) < min(src.limit, len(tasks)):
        for lv in sorted(by_level):
            if by_level[lv] and len(picked) < src.limit:
                picked.append(by_level[lv].pop())
    return sorted(picked, key=lambda t: t.id)


def _cache_for(src: SourceSpec, base: Path, key: str) -> Path:
    if src.cache:
        d = base / src.cache
        d.mkdir(parents=True, exist_ok=True)
        return d
    return cache_dir("suites", key)


def _humaneval(src: SourceSpec, base: Path, where: str) -> list[Task]:
    from opencomposer.tasks.sources import ItemError
    from opencomposer.tasks.sources.humaneval import import_humaneval, task_id

    ids = sorted(set(src.ids)) if src.ids else list(range(src.limit or 164))
    out = _cache_for(src, base, "humaneval")
    missing = [n for n in ids if not (out / task_id(f"HumanEval/{n}") / "task.toml").is_file()]
    if missing:
        try:
            env = out / "_envs" / "humaneval"
            rep = import_humaneval(out, ids=missing, env=env if env.is_dir() else None)
        except ItemError as e:
            raise SuiteError(f"{where}: {e}") from None
        if rep.failed:
            raise SuiteError(f"{where}: HumanEval import failed: {rep.failed}")
    return [_load(out / task_id(f"HumanEval/{n}"), where) for n in ids]


def _imported(src: SourceSpec, base: Path, where: str) -> list[Task]:
    """Harbor / SWE-bench: imported once into a cache dir keyed by the source's path."""

    path = (base / src.path).resolve()
    if not path.exists():
        raise SuiteError(f"{where}: path {src.path!r} ({path}) does not exist")
    key = hashlib.sha1(f"{path}|{src.repos}|{src.env}".encode()).hexdigest()[:12]
    out = _cache_for(src, base, f"{src.kind}-{key}")
    done = out / ".imported"
    env = Path(sys.prefix) if src.env == "current" else None  # else one env built per source
    if not done.exists():
        try:
            if src.kind == "harbor":
                from opencomposer.tasks.sources.harbor import import_harbor
                rep = import_harbor(path, out, env=env)
            else:
                from opencomposer.tasks.sources.swebench import import_swebench
                rep = import_swebench(path, (base / src.repos).resolve(), out, env=env)
        except (ValueError, OSError) as e:  # ItemError, SourceError, EnvError
            raise SuiteError(f"{where}: {e}") from None
        if not rep.ok:
            raise SuiteError(f"{where}: no task imported from {path}: {rep.summary()}")
        done.write_text("\n".join(rep.ok) + "\n")
    names = done.read_text().split()
    return [_load(out / n, where) for n in names]
