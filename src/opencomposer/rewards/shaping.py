"""The reward a rollout trains on: the task reward shaped by length, behaviour and monitors.

    shaped = shape(reward_result, traj, usage, RewardConfig())
    shaped.total, shaped.terms     # 0.83, {"task": 1.0, "length": 0.12, "invalid_calls": 0.05, ...}

    total = task' - length - sum(behaviour terms) - monitors.penalty * (kinds flagged)
    task' = 0 if a monitor flagged the episode and ``monitors.void_reward``, else the task reward

``changes``, ``lint`` and the monitors' flags are measured by ``rl/episode.run_task``
(which voids a flagged episode's reward for every caller) and stored in ``traj.meta``;
``task_reward`` here is the graded reward before that voiding (``graded_reward``), so
``[reward.monitors]`` decides for training. Shaping itself is pure, so it can be
recomputed from a saved transcript (one without stored flags is monitored again). Every
term is in ``terms`` (logged per RL step).

Test: ``pytest tests/unit/rewards/test_shaping.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opencomposer.harness.trajectory import Trajectory
from opencomposer.rewards.behaviour import behaviour_terms
from opencomposer.rewards.changes import Changes
from opencomposer.rewards.config import RewardConfig
from opencomposer.rewards.length import Usage, length_penalty
from opencomposer.rewards.lint import LintResult
from opencomposer.rewards.monitors import monitor


@dataclass
class ShapedReward:
    total: float
    terms: dict[str, float] = field(default_factory=dict)  # "task" and every penalty (positive numbers)
    flags: dict[str, list[str]] = field(default_factory=dict)


def changes_from_meta(traj: Trajectory) -> tuple[Changes | None, LintResult | None]:
    c, lint = traj.meta.get("changes"), traj.meta.get("lint")
    changes = Changes.from_dict(c) if c else None
    return changes, (LintResult(**lint) if lint else None)


def shape(task_reward: float, passed: bool, traj: Trajectory, usage: Usage, cfg: RewardConfig) -> ShapedReward:
    changes, lint = changes_from_meta(traj)
    flags: dict[str, list[str]] = {}
    if cfg.monitors.enabled:
        stored = traj.meta.get("monitor")
        flags = stored["flags"] if stored is not None else monitor(traj, changes).flags
    flagged = bool(flags)
    task = 0.0 if flagged and cfg.monitors.void_reward else task_reward
    terms = {"task": task, "length": length_penalty(usage, cfg.length, passed and not flagged)}
    terms.update(behaviour_terms(traj, lint, changes, cfg.behaviour))
    terms["hacking"] = cfg.monitors.penalty * len(flags) if flagged else 0.0
    total = task - sum(v for k, v in terms.items() if k != "task")
    return ShapedReward(total=total, terms=terms, flags=flags)
