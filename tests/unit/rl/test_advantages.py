"""Group advantages: equal groups give exact zeros, std division only when asked."""

from __future__ import annotations

import math

import pytest

from opencomposer.rl.advantages import advantages_for_groups, group_advantages


@pytest.mark.parametrize("std_normalize", [False, True])
@pytest.mark.parametrize("rewards", [[1.0] * 4, [0.0] * 8, [0.1] * 3, [0.7], [-2.5] * 5])
def test_equal_rewards_give_exact_zeros(rewards, std_normalize):
    # [0.1] * 3 is the trap: 0.1 - mean([0.1] * 3) is -1.4e-17, not 0, in floats.
    assert group_advantages(rewards, std_normalize=std_normalize) == [0.0] * len(rewards)


def test_mean_subtracted_without_std():
    adv = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert adv == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert math.fsum(adv) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("rewards", [[1.0, 0.0], [0.3, 0.9, 0.1, 0.1, 0.5], [5.0, -1.0, 2.0]])
def test_mean_zero_and_std_only_when_asked(rewards):
    plain = group_advantages(rewards)
    scaled = group_advantages(rewards, std_normalize=True)
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))  # population std
    assert sum(plain) == pytest.approx(0.0, abs=1e-12)
    assert sum(scaled) == pytest.approx(0.0, abs=1e-12)
    assert plain == pytest.approx([r - mean for r in rewards])
    assert scaled == pytest.approx([(r - mean) / std for r in rewards])
    assert std != pytest.approx(1.0)  # so plain and scaled really differ


def test_binary_pair_maps_to_plus_minus_one():
    assert group_advantages([1.0, 0.0], std_normalize=True) == pytest.approx([1.0, -1.0])


def test_spread_within_eps_counts_as_equal():
    assert group_advantages([1.0, 1.0 + 1e-9], std_normalize=True) == [0.0, 0.0]


def test_advantages_for_groups_keeps_tasks_apart():
    out = advantages_for_groups({"easy": [1.0, 1.0, 1.0], "mixed": [1.0, 0.0]}, std_normalize=True)
    assert out == {"easy": [0.0, 0.0, 0.0], "mixed": pytest.approx([1.0, -1.0])}


def test_bad_groups_raise_with_task_name():
    with pytest.raises(ValueError, match="empty"):
        group_advantages([])
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages([1.0, float("nan")])
    with pytest.raises(ValueError, match="'t9'"):
        advantages_for_groups({"t9": []})
