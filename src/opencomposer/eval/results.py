"""The eval results file (``opencomposer.eval/1``): episode records, the summary built from
them, loading with schema checks, and per-task scores for the gate and the report.

This is the one place the episode metrics are computed; ``run_suite`` and the in-run
held-out eval (``eval/heldout.py``) both call :func:`summarize`, and the report and the
gate rebuild everything from the ``episodes`` list alone.

    res = load_results("runs/eval/smoke/results.json")     # or the directory holding it
    per_task(res, "pass@1")                               # {"task-a": 0.5, ...}

Test: ``pytest tests/unit/eval/test_results.py``.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from opencomposer.rl.metrics import pass_at_k

SCHEMA = "opencomposer.eval/1"

# episode field -> type it must have (bool is an int in Python; we refuse it for counts).
EPISODE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "task_id": str, "difficulty": str, "sample": int, "reward": (int, float),
    "completion_tokens": int, "prompt_tokens": int, "tool_calls": int, "invalid_calls": int,
    "seconds": (int, float), "stop_reason": str,
}

# metric name -> (episode field averaged per task, higher is better). pass@k is special.
EPISODE_METRICS: dict[str, tuple[str, bool]] = {
    "mean_completion_tokens": ("completion_tokens", False),
    "tool_calls": ("tool_calls", False),
    "invalid_calls": ("invalid_calls", False),
    "wall_s": ("seconds", False),
    "reward": ("reward", True),
}


class ResultsError(ValueError):
    """A results file that is missing, unreadable or not ``opencomposer.eval/1``."""


class EvalError(RuntimeError):
    """A suite run that produced no score at all (every episode broke before grading)."""


def passed(reward: float) -> bool:
    """An episode passes when the all-or-nothing test reward is 1 (``grading/grade.py``)."""
    return reward >= 1.0


def task_groups(episodes: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    groups: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for ep in episodes:
        groups[ep["task_id"]].append(ep)
    return dict(groups)


def summarize(episodes: Sequence[Mapping[str, Any]], k: int, *, wall_s: float,
              price_per_mtok: float = 0.0, prompt_price_per_mtok: float | None = None) -> dict:
    """The ``summary`` block: pass rates average over tasks (each task weighs the same),
    the per-episode figures average over episodes; ``cost_usd`` is the whole run's
    ``(prompt_tokens x prompt price + completion_tokens x price) / 1e6``."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not episodes:
        raise ValueError("no episodes to summarize")
    groups = task_groups(episodes)
    p1, pk = {}, {}
    for tid, eps in groups.items():
        n, c = len(eps), sum(passed(e["reward"]) for e in eps)
        p1[tid] = pass_at_k(n, c, 1)
        pk[tid] = pass_at_k(n, c, min(k, n))
    levels: dict[str, list[str]] = defaultdict(list)
    for tid, eps in groups.items():
        levels[eps[0]["difficulty"]].append(tid)
    n_ep = len(episodes)
    prompt_price = price_per_mtok if prompt_price_per_mtok is None else prompt_price_per_mtok
    cost = sum(e["completion_tokens"] * price_per_mtok + e["prompt_tokens"] * prompt_price
               for e in episodes) / 1e6

    def mean(field: str) -> float:
        return math.fsum(e[field] for e in episodes) / n_ep

    return {
        "tasks": len(groups), "episodes": n_ep,
        "pass@1": math.fsum(p1.values()) / len(p1),
        "pass@k": math.fsum(pk.values()) / len(pk),
        "mean_completion_tokens": mean("completion_tokens"),
        "mean_prompt_tokens": mean("prompt_tokens"),
        "tool_calls": mean("tool_calls"),
        "invalid_calls": mean("invalid_calls"),
        "mean_episode_s": mean("seconds"),
        "hacking_flagged": sum(bool(e.get("hacking_flagged")) for e in episodes) / n_ep,
        "wall_s": round(wall_s, 3),
        "cost_usd": cost,
        "per_difficulty": {
            lvl: {"pass@1": math.fsum(p1[t] for t in tids) / len(tids),
                  "pass@k": math.fsum(pk[t] for t in tids) / len(tids), "n": len(tids)}
            for lvl, tids in sorted(levels.items())},
    }


def pass_at_k_curve(results: Mapping[str, Any]) -> list[float]:
    """Mean over tasks of unbiased pass@j for j = 1..K, K = the fewest samples of any task."""
    groups = task_groups(results["episodes"])
    kmax = min(len(eps) for eps in groups.values())
    curve = []
    for j in range(1, kmax + 1):
        vals = [pass_at_k(len(eps), sum(passed(e["reward"]) for e in eps), j)
                for eps in groups.values()]
        curve.append(math.fsum(vals) / len(vals))
    return curve


def metric_direction(metric: str) -> bool:
    """True when higher is better. Known: pass@1, pass@k, pass@<int>, and EPISODE_METRICS."""
    if metric in ("pass@1", "pass@k") or _pass_k(metric) is not None:
        return True
    if metric in EPISODE_METRICS:
        return EPISODE_METRICS[metric][1]
    known = ["pass@1", "pass@k", "pass@<k>", *EPISODE_METRICS]
    raise ResultsError(f"unknown metric {metric!r}; expected one of {known}")


def per_task(results: Mapping[str, Any], metric: str, k: int | None = None) -> dict[str, float]:
    """Score of every task under ``metric``: pass@1 / pass@k (unbiased, from its samples;
    ``k`` defaults to the file's k, capped at the task's sample count) or the mean of an
    episode field (``mean_completion_tokens``, ``tool_calls``, ...)."""
    metric_direction(metric)  # validates the name
    groups = task_groups(results["episodes"])
    out: dict[str, float] = {}
    for tid, eps in groups.items():
        n = len(eps)
        if metric.startswith("pass@"):
            kk = 1 if metric == "pass@1" else (_pass_k(metric) or k or int(results["k"]))
            out[tid] = pass_at_k(n, sum(passed(e["reward"]) for e in eps), min(kk, n))
        else:
            field = EPISODE_METRICS[metric][0]
            out[tid] = math.fsum(float(e[field]) for e in eps) / n
    return out


def _pass_k(metric: str) -> int | None:
    tail = metric.removeprefix("pass@")
    return int(tail) if tail != metric and tail.isdigit() and int(tail) >= 1 else None


def results_path(path: str | Path) -> Path:
    """``path`` itself, or ``path/results.json`` when it is a directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    if not p.is_file():
        raise ResultsError(f"{path}: no results file (expected a results.json or a directory holding one)")
    return p


def load_results(src: str | Path | Mapping[str, Any]) -> dict:
    """Read and validate a results file (or directory holding ``results.json``, or a dict)."""
    if isinstance(src, Mapping):
        return validate(dict(src), "<results dict>")
    p = results_path(src)
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ResultsError(f"{p}: not JSON ({e})") from None
    return validate(data, str(p))


def pool_results(sources: Sequence[str | Path | Mapping[str, Any]]) -> dict:
    """Several results files of one stage (e.g. the same model sampled under two seeds, or two RL seeds'
    models) as one: each task's episodes from every file count together, samples renumbered file after
    file, ``k`` their sum. The files must be of one suite with one ``k``; an error names the file that is not."""
    if not sources:
        raise ResultsError("no results files to pool")
    runs = [load_results(src) for src in sources]
    names = [str(src) if not isinstance(src, Mapping) else f"<results dict {i}>" for i, src in enumerate(sources)]
    first = runs[0]
    for name, r in zip(names[1:], runs[1:]):
        for key in ("suite", "k"):
            if r[key] != first[key]:
                raise ResultsError(f"{name}: field {key!r} is {r[key]!r}, expected {first[key]!r} as in {names[0]} "
                                   "(pooled files are one stage's samples of one suite)")
    episodes = []
    for j, r in enumerate(runs):
        episodes += [{**ep, "sample": int(ep["sample"]) + j * int(first["k"])} for ep in r["episodes"]]
    return {**first, "label": "+".join(r["label"] for r in runs), "k": int(first["k"]) * len(runs),
            "episodes": episodes, "pooled_from": names}  # every file validated as it was loaded


def validate(data: Any, where: str) -> dict:
    """Check the schema tag, top-level fields and every episode record; errors name the
    file, the field and the value found."""
    if not isinstance(data, dict):
        raise ResultsError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise ResultsError(f"{where}: field 'schema' is {data.get('schema')!r}, expected {SCHEMA!r}")
    for key, typ in (("suite", str), ("label", str), ("k", int), ("episodes", list)):
        v = data.get(key)
        if not isinstance(v, typ) or isinstance(v, bool):
            raise ResultsError(f"{where}: field {key!r} is {v!r}, expected {typ.__name__}")
    if data["k"] < 1:
        raise ResultsError(f"{where}: field 'k' is {data['k']}, expected >= 1")
    if not data["episodes"]:
        raise ResultsError(f"{where}: field 'episodes' is empty")
    for i, ep in enumerate(data["episodes"]):
        if not isinstance(ep, dict):
            raise ResultsError(f"{where}: episodes[{i}] is {type(ep).__name__}, expected an object")
        for f, typ in EPISODE_FIELDS.items():
            v = ep.get(f)
            if not isinstance(v, typ) or isinstance(v, bool) or (isinstance(v, float) and not math.isfinite(v)):
                raise ResultsError(f"{where}: episodes[{i}].{f} is {v!r}, expected "
                                   f"{getattr(typ, '__name__', 'a number')}")
    return data
