"""Which deletions to try, in which order, and the journal that lets a killed run resume.

    jobs = draw_jobs(prep, {"body": 1.0, "function": 1.0}, random.Random(0))  # [(candidate, level), ...]
    journal = Journal(out / "_journal" / f"{slug}.jsonl", batch_id(0, weights))
    todo = [j for j in jobs if job_key(*j) not in journal.tried]

A job is a (candidate or feature, level) pair; levels are drawn by weight among those that
still have unused candidates, and a function gives at most two jobs (``job_key``).

Every job tried is appended to ``OUT/_journal/<slug>.jsonl`` with its outcome. A rerun of the
same command (same seed and level weights: the same *batch*, ``batch_id``) skips what was
tried and counts what was made towards ``max_tasks``; a new batch (``TaskFactory.harder``
moved the levels, or another seed) skips every job any batch tried but starts its own count.

Test: ``pytest tests/unit/tasks/test_resume.py``.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

from opencomposer.tasks import deletion
from opencomposer.tasks.prepare import Prepared


def job_key(obj, level: str) -> str:
    """What a job uses up: a function's ``line`` or ``block`` (one inner statement) or its whole
    body (``body``, ``function`` and a ``feature`` anchored on it all remove that), or a class."""
    cand = obj.anchor if isinstance(obj, deletion.Feature) else obj
    return f"{cand.id}#{level if level in ('line', 'block') else 'whole'}"


def draw_jobs(prep: Prepared, weights: dict[str, float], rng: random.Random) -> list[tuple[object, str]]:
    """(candidate or feature, level) pairs in the order to try them: each draw picks a level with
    probability proportional to its weight among levels that still have unused candidates,
    then an unused candidate of that level. A function gives at most three jobs: one line
    deletion, one block deletion and one whole-body one (body, function or a feature anchored on it)."""
    classes = weights.get("class", 0) > 0
    cands = deletion.find_candidates(prep.root, prep.layout.package_dirs,
                                     prep.test_map.lines if prep.test_map else None, classes=classes)
    funcs = [c for c in cands if c.kind == "function"]
    pools: dict[str, list] = {
        "line": [c for c in funcs if "line" in c.levels],
        "block": [c for c in funcs if "block" in c.levels],
        "body": list(funcs),
        "function": [c for c in funcs if "function" in c.levels],
        "class": [c for c in cands if c.kind == "class"],
        "feature": deletion.find_features(funcs) if weights.get("feature", 0) > 0 else [],
    }
    for p in pools.values():
        rng.shuffle(p)
    used: set[str] = set()
    jobs = []
    while True:
        live = [lv for lv, w in weights.items() if w > 0 and pools.get(lv)]
        if not live:
            return jobs
        lv = rng.choices(live, [weights[x] for x in live])[0]
        obj = pools[lv].pop()
        key = job_key(obj, lv)
        if key not in used:
            used.add(key)
            jobs.append((obj, lv))


class Journal:
    """``OUT/_journal/<slug>.jsonl``: one line per job tried (key, level, batch, outcome, task
    id if made) plus one per session start; appended under a lock, read back on resume."""

    def __init__(self, path: Path, batch: str):
        self.path, self.batch = path, batch
        self.session = f"{time.time():.3f}"
        self.tried: dict[str, dict] = {}  # job key -> its latest line
        self.seconds: dict[str, float] = {}  # session -> seconds it ran (latest line's "s")
        if path.exists():
            for raw in path.read_text().splitlines():
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue  # a line cut short by a kill: that job is simply tried again
                if "key" in line:
                    self.tried[line["key"]] = line
                if "session" in line:
                    self.seconds[line["session"]] = max(self.seconds.get(line["session"], 0.0), line.get("s", 0.0))
        path.parent.mkdir(parents=True, exist_ok=True)
        torn = path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
        self._f = open(path, "a")  # noqa: SIM115 - held for the journal's life, closed by close()
        self._lock = threading.Lock()
        if torn:  # a kill cut the last line short: start ours on a fresh line
            self._f.write("\n")

    def add(self, line: dict, t0: float) -> None:
        line = {**line, "batch": self.batch, "session": self.session, "s": round(time.time() - t0, 1)}
        with self._lock:
            self._f.write(json.dumps(line) + "\n")
            self._f.flush()
            if "key" in line:
                self.tried[line["key"]] = line

    def earlier_seconds(self) -> float:
        return sum(s for k, s in self.seconds.items() if k != self.session)

    def close(self) -> None:
        self._f.close()


def batch_id(seed: int, weights: dict[str, float]) -> str:
    """The journal's name for one batch: its seed and level weights."""
    return f"seed{seed}:" + ",".join(f"{lv}={w:g}" for lv, w in sorted(weights.items()) if w > 0)

