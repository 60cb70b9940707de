"""Train / validation / held-out splits of a task pool by source file, so nothing leaks across.

    s = split_by_file(task_dirs, heldout=0.12, validation=0.08, seed=2026)
    s.train, s.validation, s.heldout      # lists of task dirs
    s.groups["toolz==1.2.0"]              # {"heldout": [...files], "validation": [...], "train": [...]}

A factory task deletes code from one file of a library (``task.toml`` ``[source] spec`` and
``[feature] file``). Tasks are split by that (library, file) pair, never one by one: a function's
``block``, ``body`` and ``function`` tasks, and its class's ``class`` task, fall on the same side,
and an SFT trace that reads the file it edits never shows a held-out task's answer. Within each
library the files are ordered by a seeded hash of their name and taken into ``heldout`` until it
holds at least its share of the library's tasks (skipping a file that would overshoot the share by
half again), then into ``validation``; the rest train. A library keeps at least half its tasks for training (one whose files are too few to split trains
whole). The split depends only on the seed and the tasks of each (library, file), not on their order
or the machine: the same pool and seed give the same split anywhere.

Validation tasks are for choosing settings; held-out tasks are for the final figures only.

Test: ``pytest tests/unit/tasks/test_splits.py``.
"""

from __future__ import annotations

import hashlib
import tomllib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path


class SplitError(ValueError):
    pass


@dataclass
class Split:
    train: list[Path] = field(default_factory=list)
    validation: list[Path] = field(default_factory=list)
    heldout: list[Path] = field(default_factory=list)
    groups: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    def summary(self) -> dict:
        return {"train": len(self.train), "validation": len(self.validation), "heldout": len(self.heldout),
                "libraries": len(self.groups)}


def task_key(task_dir: Path) -> tuple[str, str]:
    """(library spec, file) of a factory task, read from its ``task.toml``."""
    path = Path(task_dir) / "task.toml"
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SplitError(f"{path}: cannot read the task ({e})") from e
    spec = (data.get("source") or {}).get("spec")
    file = (data.get("feature") or {}).get("file")
    if not spec or not file:
        raise SplitError(f"{path}: [source] spec and [feature] file are needed to split by file; got "
                         f"spec={spec!r}, file={file!r}")
    return spec, file


def _rank(seed: int, spec: str, file: str) -> str:
    return hashlib.sha256(f"{seed}\0{spec}\0{file}".encode()).hexdigest()


def split_by_file(task_dirs: list[Path], heldout: float, validation: float, seed: int) -> Split:
    """Split ``task_dirs`` by (library, file); see the module docstring."""
    for name, share in (("heldout", heldout), ("validation", validation)):
        if not 0 <= share < 1:
            raise SplitError(f"{name} share must be in [0, 1), got {share}")
    if heldout + validation > 0.5:
        raise SplitError(f"heldout + validation = {heldout + validation} leaves less than half the tasks to train on")
    by_file: dict[str, dict[str, list[Path]]] = defaultdict(lambda: defaultdict(list))
    for d in sorted(Path(p) for p in task_dirs):
        spec, file = task_key(d)
        by_file[spec][file].append(d)
    out = Split()
    for spec in sorted(by_file):
        files = sorted(by_file[spec], key=lambda f: _rank(seed, spec, f))
        total = sum(len(v) for v in by_file[spec].values())
        sides: dict[str, list[str]] = {"heldout": [], "validation": [], "train": []}
        counts = {"heldout": 0, "validation": 0}
        for f in files:
            n = len(by_file[spec][f])
            side = "train"
            for name, share in (("heldout", heldout), ("validation", validation)):
                # a side takes files until it holds its share, none that would overshoot it by half
                # again (a big file trains instead); the library keeps half its tasks to train on
                if (share and counts[name] < share * total and counts[name] + n <= 1.5 * share * total
                        and counts["heldout"] + counts["validation"] + n <= total / 2):
                    side = name
                    break
            if side != "train":
                counts[side] += n
            sides[side].append(f)
            getattr(out, side).extend(by_file[spec][f])
        out.groups[spec] = sides
    return out
