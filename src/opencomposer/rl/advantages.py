"""Group-relative advantages: each rollout's reward against the others of its task.

GRPO (Shao et al. 2024, DeepSeekMath) samples K rollouts per task and uses
``A_i = (r_i - mean(r)) / std(r)`` in place of a learned value function. Composer 2
(Cursor, 2026) keeps the group baseline but changes the scaling, and so do we:

* Division by the group's standard deviation is opt-in (``std_normalize=True``).
  With all-or-nothing test rewards, std only rescales a group by how balanced its
  successes are, which up-weights tasks that are almost always solved or failed.
* A group whose K rewards are all equal carries no signal: every advantage is exactly
  0.0. Dividing its floating-point residue (``0.1 - mean([0.1] * 3)`` is ``-1.4e-17``)
  by a std near zero is the noise amplification the recipe warns about.

    group_advantages([1.0, 0.0, 0.0, 1.0])                    # [0.5, -0.5, -0.5, 0.5]
    group_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=True)  # [1.0, -1.0, -1.0, 1.0]
    advantages_for_groups({"task-a": [1.0, 1.0], "task-b": [0.0, 1.0]})
    split_groups({"a": [1.0, 1.0], "b": [0.0, 1.0]})    # informative ["b"], zero_variance ["a"]

``split_groups`` sorts a step's groups into informative ones and zero-variance ones (every
advantage 0.0, the group teaches nothing), and counts the groups whose task rewards all
passed or all failed: what ``[rollout] zero_variance`` (``rl/actor.py``) skips or resamples.

Test: ``pytest tests/unit/rl/test_advantages.py tests/unit/rl/test_informative.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["GroupSplit", "advantages_for_groups", "group_advantages", "is_zero_variance", "split_groups"]


def group_advantages(
    rewards: Sequence[float], std_normalize: bool = False, eps: float = 1e-6
) -> list[float]:
    """Advantages of one task's K rollouts: ``r - mean(r)``, optionally ``/ std(r)``.

    ``std`` is the population standard deviation (divide by K, not K-1): the group is
    the whole sample we score against, and K=2 then maps {0, 1} to {-1, +1}.
    Rewards that differ by no more than ``eps`` count as equal and get zero advantages;
    the std division happens only when ``std_normalize`` is set and ``std > eps``.
    """
    values = [float(r) for r in rewards]
    if not values:
        raise ValueError("group_advantages: empty reward group (a task with no rollouts)")
    bad = [r for r in values if not math.isfinite(r)]
    if bad:
        # A NaN reward would silently poison every advantage of the group.
        raise ValueError(f"group_advantages: non-finite rewards {bad} in group {values}")
    if eps < 0:
        raise ValueError(f"group_advantages: eps must be >= 0, got {eps}")

    # Equal rewards -> exact zeros, not mean-subtraction residue that a later
    # division (here or by a caller) could blow up.
    if max(values) - min(values) <= eps:
        return [0.0] * len(values)

    mean = math.fsum(values) / len(values)
    advantages = [r - mean for r in values]
    if std_normalize:
        std = math.sqrt(math.fsum(a * a for a in advantages) / len(values))
        if std > eps:
            advantages = [a / std for a in advantages]
    return advantages


def advantages_for_groups(
    groups: Mapping[str, Sequence[float]], std_normalize: bool = False, eps: float = 1e-6
) -> dict[str, list[float]]:
    """``group_advantages`` for every task id; rollouts of different tasks never mix.

    The baseline is per task because tasks differ wildly in difficulty: a shared batch
    mean would reward every rollout of an easy task and punish every one of a hard task.
    """
    out: dict[str, list[float]] = {}
    for task_id, rewards in groups.items():
        try:
            out[task_id] = group_advantages(rewards, std_normalize=std_normalize, eps=eps)
        except ValueError as err:
            raise ValueError(f"task {task_id!r}: {err}") from None
    return out


def is_zero_variance(rewards: Sequence[float], eps: float = 1e-6) -> bool:
    """True when a group's rewards are all equal (within ``eps``): ``group_advantages`` gives
    it only zeros, so it carries no policy-gradient signal (all K rollouts passed, or all failed)."""
    values = [float(r) for r in rewards]
    if not values:
        raise ValueError("is_zero_variance: empty reward group (a task with no rollouts)")
    return max(values) - min(values) <= eps


@dataclass
class GroupSplit:
    """A step's groups by what they teach (``split_groups``); lists of task ids, in input order."""

    informative: list[str] = field(default_factory=list)  # rewards differ: non-zero advantages
    zero_variance: list[str] = field(default_factory=list)  # rewards all equal: every advantage 0
    all_pass: list[str] = field(default_factory=list)  # every task reward passed
    all_fail: list[str] = field(default_factory=list)  # every task reward failed

    def metrics(self) -> dict[str, float]:
        """``groups_informative``, ``groups_zero_variance``, ``groups_all_pass``, ``groups_all_fail``."""
        return {f"groups_{k}": float(len(getattr(self, k)))
                for k in ("informative", "zero_variance", "all_pass", "all_fail")}

    def extend(self, other: GroupSplit) -> None:
        for k in ("informative", "zero_variance", "all_pass", "all_fail"):
            getattr(self, k).extend(getattr(other, k))


def split_groups(train_rewards: Mapping[str, Sequence[float]],
                 task_rewards: Mapping[str, Sequence[float]] | None = None,
                 pass_threshold: float = 1.0, eps: float = 1e-6) -> GroupSplit:
    """Sort groups (task id -> the K rewards the update uses) into informative and zero-variance.

    Zero variance is judged on ``train_rewards`` (shaped: what the advantages are computed
    from); all-pass / all-fail on ``task_rewards`` (the hidden tests; ``train_rewards`` when not
    given), a rollout passing when its reward is ``>= pass_threshold`` as in ``summarize_groups``.
    The two usually name the same groups; shaping (a length penalty that differs among K
    passing rollouts) can make an all-pass group informative.
    """
    out = GroupSplit()
    for task_id, rewards in train_rewards.items():
        (out.zero_variance if is_zero_variance(rewards, eps) else out.informative).append(task_id)
        passed = [float(r) >= pass_threshold for r in (task_rewards or train_rewards)[task_id]]
        if passed and all(passed):
            out.all_pass.append(task_id)
        elif not any(passed):
            out.all_fail.append(task_id)
    return out
