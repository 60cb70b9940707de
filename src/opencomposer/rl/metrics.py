"""Rollout-group metrics: unbiased pass@k and a per-step summary of reward groups.

pass@k is the probability that at least one of k rollouts drawn (without replacement)
from the n we ran passes, given c of them passed. The unbiased estimator of Chen et
al. 2021 (Codex, "Evaluating Large Language Models Trained on Code") is
``1 - C(n-c, k) / C(n, k)``; the binomials overflow floats for large n, so we use the
equivalent product ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``.

    pass_at_k(n=8, c=2, k=4)                                  # 0.7857...
    summarize_groups({"t1": [1.0, 0.0, 0.0], "t2": [0.0] * 3}, k=2)
    rollout_stats(rollouts, k=4)                 # + tokens, tool calls, turns per rollout
    rollout_times(rollouts, policy_stats, engine_stats)   # where the batch's time went
    MetricsLog(out).write(row)                   # a step's row to metrics.jsonl (and TensorBoard)
    train_curves(rows)                           # the report's per-update curves (pipeline/report.py)

TensorBoard (``<out>/tb``, when tensorboard is installed): every numeric key of a row under
its own name (``reward_mean``, ``pass@1``, ``loss``, ...), plus the report's curves, the same
figures ``train_curves`` gives the PNG, at step = the update:

* ``train/reward_mean``: mean task reward of the update's rollouts;
* ``train/reward_mean_rolling``: its mean over the last ``ROLLING`` (10) updates;
* ``train/tokens_per_episode``: mean completion tokens per rollout;
* ``train/invalid_call_rate``: invalid tool calls / all tool calls of the update (0 without calls).

The held-out curves (``heldout/...``) are the report's (``pipeline/report.py``).

Test: ``pytest tests/unit/rl/test_metrics.py tests/unit/pipeline/test_run_report.py``.
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

__all__ = ["MetricsLog", "ROLLING", "TRAIN_TAGS", "pass_at_k", "placement_stats", "rollout_stats", "summarize_groups",
           "train_curves"]

ROLLING = 10  # updates in the rolling mean of the train reward
# TensorBoard tag -> train_curves key
TRAIN_TAGS = {"train/reward_mean": "reward_mean", "train/reward_mean_rolling": "reward_mean_rolling",
              "train/tokens_per_episode": "tokens_per_episode", "train/invalid_call_rate": "invalid_call_rate"}


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
        "invalid_call_rate": _ratio(sum(t.invalid_calls for t in trajs), sum(t.tool_calls for t in trajs)),
        "turns": sum(t.turns for t in trajs) / n,
        "summaries": sum(t.summaries for t in trajs) / n,  # self-summaries per rollout
        "submitted": sum(t.exit_reason == "submitted" for t in trajs) / n,
        "failed_rollouts": sum(r.result is None for r in rollouts),
        **placement_stats(trajs),
    }


def placement_stats(trajs: list) -> dict[str, float]:
    """Where the rollouts' changes sit against the gold patch (``rewards/placement.py``), as shares of
    the rollouts it was measured on: the gold's file changed, a change at the gold's line, within 2
    lines of it, the gold's text written. Empty when no rollout has it (e.g. a gold over several files)."""
    ps = [t.meta["placement"] for t in trajs if t.meta.get("placement")]
    if not ps:
        return {}
    n = len(ps)
    dist = [p.get("edit_line_distance") for p in ps]
    return {"edit_gold_file": sum(p.get("edit_gold_file", 0.0) for p in ps) / n,
            "edit_at_gold_line": sum(d == 0 for d in dist if d is not None) / n,
            "edit_near_gold_line": sum(d <= 2 for d in dist if d is not None) / n,
            "edit_gold_text": sum(p.get("edit_gold_text", 0.0) for p in ps) / n}


def rollout_times(rollouts: list[Rollout], policy_stats: Mapping[str, float],
                  engine_stats: Mapping[str, float] | None = None) -> dict[str, float]:
    """Where a rollout batch's time went, per episode and in the engine (this batch's deltas).

    Per episode (means; ``episode_s_max``: the slowest, which the step waits for, and its parts as
    ``episode_max_<part>_s``): ``sandbox``
    set-up, the agent loop split into ``policy`` (waiting for generation, queue included) and
    ``tools`` (the rest: commands, edits), and ``reward`` (grading in a fresh sandbox).
    ``queue_s_mean``: a request's wait for room in the engine (``[rollout] max_batch``). Engine
    (the built-in one): prefill and decode seconds, prompt tokens and those the prefix cache
    spared (``prefix_hit_fraction``), generated tokens, steps, and the stepping thread's wall and
    CPU seconds in steps (``engine_step_s``, ``engine_step_cpu_s``: the difference is waiting, for
    the device or for the GIL; ``engine_step_runqueue_s``: the stepping thread runnable but without a core)."""
    eps = [r.result for r in rollouts if r.result is not None]
    n = max(len(eps), 1)
    total = [e.seconds.get("total", 0.0) for e in eps]
    parts = [_episode_parts(e) for e in eps]  # each episode's sandbox, policy, tools and reward seconds
    out = {"episode_s_mean": sum(total) / n, "episode_s_max": max(total, default=0.0),
           **{f"episode_{k}_s_mean": sum(p[k] for p in parts) / n for k in EPISODE_PARTS},
           "queue_s_mean": _ratio(float(policy_stats.get("queue_seconds", 0.0)), float(policy_stats.get("requests", 0)))}
    if eps:  # the slowest episode, which the step waited for, in the same parts
        slowest = parts[max(range(len(eps)), key=total.__getitem__)]
        out.update({f"episode_max_{k}_s": slowest[k] for k in EPISODE_PARTS})
    if engine_stats:
        prompt = float(engine_stats.get("prompt_tokens", 0))
        out.update({"engine_prefill_s": float(engine_stats.get("prefill_seconds", 0.0)),
                    "engine_decode_s": float(engine_stats.get("decode_seconds", 0.0)),
                    "engine_prompt_tokens": prompt,
                    "prefix_hit_fraction": _ratio(prompt - float(engine_stats.get("prefill_tokens_computed", 0)), prompt),
                    "engine_generated_tokens": float(engine_stats.get("generated_tokens", 0)),
                    "engine_steps": float(engine_stats.get("steps", 0)),
                    # the stepping thread's wall time and CPU time: wall - CPU is waiting (device, GIL or a core)
                    "engine_step_s": float(engine_stats.get("step_seconds", 0.0)),
                    "engine_step_cpu_s": float(engine_stats.get("step_cpu_seconds", 0.0)),
                    "engine_step_runqueue_s": float(engine_stats.get("step_runqueue_seconds", 0.0))})
    return {k: round(v, 4) for k, v in out.items()}


EPISODE_PARTS = ("sandbox", "policy", "tools", "reward")


def _episode_parts(e: Any) -> dict[str, float]:
    """An episode's seconds by ``EPISODE_PARTS``: the agent loop is waiting for generation (policy,
    queue included) and the rest (tools: commands, edits)."""
    policy = sum(s.policy_seconds for s in e.trajectory.steps)
    return {"sandbox": e.seconds.get("sandbox", 0.0), "policy": policy,
            "tools": max(e.seconds.get("episode", 0.0) - policy, 0.0), "reward": e.seconds.get("reward", 0.0)}


def wall_clock(key: str) -> bool:
    """Whether a row key measures wall-clock seconds (``time_*``, ``*_s``, ``*_s_mean``,
    ``*_s_max``): the keys two runs of the same seed may differ in."""
    return key.startswith("time_") or key.endswith(("_s", "_s_mean", "_s_max"))


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def invalid_call_rate(row: Mapping[str, Any]) -> float:
    """Invalid / all tool calls of a row (rows before ``invalid_call_rate`` was logged: from
    the per-rollout means, whose ratio is the same)."""
    if "invalid_call_rate" in row:
        return float(row["invalid_call_rate"])
    return _ratio(float(row.get("invalid_calls", 0.0)), float(row.get("tool_calls", 0.0)))


def train_curves(rows: Sequence[Mapping[str, Any]], window: int = ROLLING) -> dict[str, list[float]]:
    """Per update (``rows`` in step order): ``step``, ``reward_mean``, ``reward_mean_rolling``
    (over the last ``window`` updates, fewer at the start), ``tokens_per_episode`` and
    ``invalid_call_rate``; the shaped reward too (``shaped_reward_mean``) when every row has it."""
    reward = [float(r.get("reward_mean", 0.0)) for r in rows]
    out: dict[str, list[float]] = {
        "step": [r["step"] for r in rows], "reward_mean": reward,
        "reward_mean_rolling": [math.fsum(reward[max(0, i + 1 - window): i + 1]) / (i + 1 - max(0, i + 1 - window))
                                for i in range(len(reward))],
        "tokens_per_episode": [float(r.get("mean_completion_tokens", 0.0)) for r in rows],
        "invalid_call_rate": [invalid_call_rate(r) for r in rows],
    }
    if rows and all("shaped_reward_mean" in r for r in rows):
        out["shaped_reward_mean"] = [float(r["shaped_reward_mean"]) for r in rows]
    return out


class MetricsLog:
    """Append-only JSONL of step metrics, plus TensorBoard scalars when available (the
    module docstring lists the ``train/...`` tags)."""

    def __init__(self, out: Path):
        self.path = out / "metrics.jsonl"
        self._rewards: list[float] | None = None  # the last ROLLING rows' reward_mean, once read
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(out / "tb"))
        except Exception:  # tensorboard not installed: JSONL only
            self.tb = None

    def write(self, row: dict[str, Any]) -> None:
        if self._rewards is None:  # the rolling mean's history: the rows already logged (a resumed run's)
            self._rewards = [float(r.get("reward_mean", 0.0)) for r in self.rows()[-ROLLING:]]
        self._rewards = (self._rewards + [float(row.get("reward_mean", 0.0))])[-ROLLING:]
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, row["step"])
            # the report's curves (train_curves' figures for this row)
            curves = {"reward_mean": self._rewards[-1],
                      "reward_mean_rolling": math.fsum(self._rewards) / len(self._rewards),
                      "tokens_per_episode": float(row.get("mean_completion_tokens", 0.0)),
                      "invalid_call_rate": invalid_call_rate(row)}
            for tag, key in TRAIN_TAGS.items():
                self.tb.add_scalar(tag, curves[key], row["step"])
            self.tb.flush()

    def truncate(self, step: int, last_row: dict | None) -> None:
        """On resume: keep rows up to the checkpointed ``step`` (a killed step's row, if
        written, is dropped; the checkpointed step's row is restored from the checkpoint)."""
        rows = [r for r in self.rows() if r["step"] <= step]
        if last_row and not any(r["step"] == step for r in rows):
            rows.append(last_row)
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))
        self._rewards = None

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(l) for l in self.path.read_text().splitlines() if l.strip()]
