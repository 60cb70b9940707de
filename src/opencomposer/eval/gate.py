"""The regression gate: is checkpoint B worse than A on the same tasks, beyond a tolerance?

    r = compare("runs/eval/base", "runs/eval/candidate", metric="pass@1", tolerance=0.02)
    r.passed, r.delta, (r.ci_low, r.ci_high)

Paired bootstrap over tasks: each task's score under ``metric`` (pass@1 from its samples,
say) is taken in both runs, ``d_t = B_t - A_t``; tasks are resampled with replacement
``n_boot`` times and the mean of ``d`` over each resample gives the ``confidence`` interval
(percentile method). Pairing by task removes the task-difficulty spread, which dwarfs the
checkpoint effect on small suites.

The rule (``strict=False``, the default): B is blocked when the whole interval lies on the
worse side of ``-tolerance`` -- for a higher-is-better metric ``ci_high < -tolerance``, for a
lower-is-better one (tokens, seconds) ``ci_low > tolerance``. So B is blocked only when the
data show, at that confidence, a regression larger than the tolerance; a noisy tie passes.
An identical run has every ``d_t = 0``, so the interval is [0, 0] and it passes for any
tolerance >= 0. With ``strict=True`` (non-inferiority) B must instead *show* it is not worse:
it passes only when the worse-side bound is within the tolerance (``ci_low >= -tolerance``),
which small suites rarely achieve for a real change.

CLI: ``opencomposer eval compare A B [--metric pass@1] [--tolerance 0.0]`` (exit 1 when blocked).
Test: ``pytest tests/unit/eval/test_gate.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from opencomposer.eval.results import (
    ResultsError,
    load_results,
    metric_direction,
    per_task,
)


@dataclass
class GateResult:
    passed: bool
    metric: str
    a: float          # mean over the common tasks, run A
    b: float          # same, run B
    delta: float      # b - a
    ci_low: float     # bootstrap interval of delta
    ci_high: float
    n_tasks: int
    reason: str
    tolerance: float = 0.0
    confidence: float = 0.95
    higher_is_better: bool = True
    strict: bool = False
    label_a: str = ""
    label_b: str = ""
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    worse_tasks: list[str] = field(default_factory=list)  # where B scored worse, worst first (10 at most)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def paired_bootstrap(diffs: np.ndarray, n_boot: int, seed: int, confidence: float) -> tuple[float, float]:
    """Percentile interval of the mean of ``diffs`` under resampling of its entries."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(diffs), size=(n_boot, len(diffs)))
    means = diffs[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def compare(a: Mapping[str, Any] | str | Path, b: Mapping[str, Any] | str | Path, *,
            metric: str = "pass@1", tolerance: float = 0.0, n_boot: int = 2000, seed: int = 0,
            confidence: float = 0.95, strict: bool = False) -> GateResult:
    """Gate B against A on the tasks both ran (see the module docstring for the rule)."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n_boot < 100:
        raise ValueError(f"n_boot must be >= 100, got {n_boot}")
    ra, rb = load_results(a), load_results(b)
    higher = metric_direction(metric)
    # pass@k compares at the same k on both sides: the smaller of the two runs' k.
    k = min(int(ra["k"]), int(rb["k"]))
    sa, sb = per_task(ra, metric, k), per_task(rb, metric, k)
    common = sorted(set(sa) & set(sb))
    if not common:
        raise ResultsError(
            f"no common tasks: A ({_name(a, ra)}, suite {ra['suite']!r}, {len(sa)} tasks) and "
            f"B ({_name(b, rb)}, suite {rb['suite']!r}, {len(sb)} tasks) share none")
    va = np.array([sa[t] for t in common])
    vb = np.array([sb[t] for t in common])
    diffs = vb - va
    lo, hi = paired_bootstrap(diffs, n_boot, seed, confidence)
    delta = float(diffs.mean())
    # Distance by which B is worse, at the interval's best and worst case for B.
    worse_best, worse_worst = (-hi, -lo) if higher else (lo, hi)
    shown = f"{metric} {va.mean():.4g} -> {vb.mean():.4g} (delta {delta:+.4g}, " \
            f"{confidence:.0%} CI [{lo:+.4g}, {hi:+.4g}], {len(common)} tasks, tolerance {tolerance:g})"
    if strict:
        ok = worse_worst <= tolerance
        reason = (f"B is not worse than A beyond the tolerance: {shown}" if ok else
                  f"B not shown within the tolerance of A (strict): {shown}")
    else:
        ok = not worse_best > tolerance
        reason = (f"B is worse than A beyond the tolerance: {shown}" if not ok else
                  f"no regression beyond the tolerance: {shown}")
    sign = 1.0 if higher else -1.0
    worse = sorted((float(d) * sign, t) for t, d in zip(common, diffs) if d * sign < 0)
    return GateResult(
        passed=bool(ok), metric=metric, a=float(va.mean()), b=float(vb.mean()), delta=delta,
        ci_low=lo, ci_high=hi, n_tasks=len(common), reason=reason, tolerance=tolerance,
        confidence=confidence, higher_is_better=higher, strict=strict,
        label_a=ra["label"], label_b=rb["label"],
        only_in_a=sorted(set(sa) - set(sb)), only_in_b=sorted(set(sb) - set(sa)),
        worse_tasks=[t for _, t in worse[:10]])


def _name(src: Any, res: Mapping[str, Any]) -> str:
    return str(src) if isinstance(src, (str, Path)) else repr(res["label"])
