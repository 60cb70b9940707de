"""Rollout-group metrics: unbiased pass@k and a per-step summary of reward groups.

pass@k is the probability that at least one of k rollouts drawn (without replacement)
from the n we ran passes, given c of them passed. The unbiased estimator of Chen et
al. 2021 (Codex, "Evaluating Large Language Models Trained on Code") is
``1 - C(n-c, k) / C(n, k)``; the binomials overflow floats for large n, so we use the
equivalent product ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``.

    pass_at_k(n=8, c=2, k=4)                                  # 0.7857...
    summarize_groups({"t1": [1.0, 0.0, 0.0], "t2": [0.0] * 3}, k=2)
    rollout_stats(rollouts, k=4)                 # + tokens, tool calls, turns per rollout
    MetricsLog(out).write(row)                   # a step's row to metrics.jsonl (and TensorBoard)

Test: ``pytest tests/unit/rl/test_metrics.py``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opencomposer.paths import atomic_write_text
from opencomposer.rl.advantages import group_advantages

if TYPE_CHECKING:  # annotations only: eval/ imports pass_at_k without loading the episode code
    from opencomposer.episode.run import Rollout

__all__ = ["MetricsLog", "pass_at_k", "rollout_stats", "summarize_groups"]


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


def rollout_stats(rollouts: list[Rollout], k: int) -> dict[str, float]:
    """``summarize_groups`` of the rollouts' rewards, plus their per-rollout means."""
    groups: dict[str, list[float]] = {}
    for r in rollouts:
        groups.setdefault(r.task_id, []).append(r.reward)
    n = max(len(rollouts), 1)
    trajs = [r.result.trajectory for r in rollouts if r.result is not None]
    return {
        **summarize_groups(groups, k),
        "mean_completion_tokens": sum(t.completion_tokens for t in trajs) / n,
        "tool_calls": sum(t.tool_calls for t in trajs) / n,
        "invalid_calls": sum(t.invalid_calls for t in trajs) / n,
        "turns": sum(t.turns for t in trajs) / n,
        "summaries": sum(t.summaries for t in trajs) / n,  # self-summaries per rollout
        "submitted": sum(t.exit_reason == "submitted" for t in trajs) / n,
        "failed_rollouts": sum(r.result is None for r in rollouts),
    }


class MetricsLog:
    """Append-only JSONL of step metrics, plus TensorBoard scalars when available."""

    def __init__(self, out: Path):
        self.path = out / "metrics.jsonl"
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(out / "tb"))
        except Exception:  # tensorboard not installed: JSONL only
            self.tb = None

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, row["step"])
            self.tb.flush()

    def truncate(self, step: int, last_row: dict | None) -> None:
        """On resume: keep rows up to the checkpointed ``step`` (a killed step's row, if
        written, is dropped; the checkpointed step's row is restored from the checkpoint)."""
        rows = [r for r in self.rows() if r["step"] <= step]
        if last_row and not any(r["step"] == step for r in rows):
            rows.append(last_row)
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(l) for l in self.path.read_text().splitlines() if l.strip()]
