"""Rollout-group metrics: unbiased pass@k and a per-step summary of reward groups.

pass@k is the probability that at least one of k rollouts drawn (without replacement)
from the n we ran passes, given c of them passed. The unbiased estimator of Chen et
al. 2021 (Codex, "Evaluating Large Language Models Trained on Code") is
``1 - C(n-c, k) / C(n, k)``; the binomials overflow floats for large n, so we use the
equivalent product ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``.

    pass_at_k(n=8, c=2, k=4)                                  # 0.7857...
    summarize_groups({"t1": [1.0, 0.0, 0.0], "t2": [0.0] * 3}, k=2)

Test: ``pytest tests/unit/rl/test_metrics.py``.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from opencomposer.rl.advantages import group_advantages

__all__ = ["pass_at_k", "summarize_groups"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n rollouts of which c passed (1 <= k <= n, 0 <= c <= n)."""
    if not (n >= 1 and 0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n, 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        # Fewer than k failures: every k-subset contains a pass.
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (i - k) / i; every factor is in (0, 1].
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def summarize_groups(
    groups: Mapping[str, Sequence[float]], k: int, pass_threshold: float = 1.0
) -> dict[str, float]:
    """Per-task metrics averaged over tasks (each task weighs the same, whatever its K).

    A rollout passes when its reward is ``>= pass_threshold``: 1.0 matches the
    all-or-nothing test reward (``grading/grade.py``); lower it when shaping (a length
    penalty, say) takes passing rewards below 1.

    Keys: ``tasks``, ``rollouts``, ``reward_mean``, ``pass@1``, ``pass@{k}``, and
    ``uniform_groups``: the fraction of tasks whose rewards are all equal, which get zero
    advantages and so teach nothing this step (all solved or all failed).
    """
    if k < 1:
        raise ValueError(f"summarize_groups: k must be >= 1, got {k}")
    if not groups:
        raise ValueError("summarize_groups: no groups")

    reward_means, p1, pk, uniform, rollouts = [], [], [], 0, 0
    for task_id, rewards in groups.items():
        values = [float(r) for r in rewards]
        n = len(values)
        if n < k:
            raise ValueError(f"task {task_id!r} has {n} rollouts, fewer than k={k} for pass@{k}")
        if not all(math.isfinite(r) for r in values):
            raise ValueError(f"task {task_id!r} has non-finite rewards: {values}")
        c = sum(r >= pass_threshold for r in values)
        reward_means.append(math.fsum(values) / n)
        p1.append(pass_at_k(n, c, 1))
        pk.append(pass_at_k(n, c, k))
        # Same notion of "no signal" as the advantages, so the metric means what it says.
        uniform += not any(group_advantages(values))
        rollouts += n

    tasks = len(reward_means)
    return {
        "tasks": float(tasks),
        "rollouts": float(rollouts),
        "reward_mean": math.fsum(reward_means) / tasks,
        "pass@1": math.fsum(p1) / tasks,
        f"pass@{k}": math.fsum(pk) / tasks,
        "uniform_groups": uniform / tasks,
    }
