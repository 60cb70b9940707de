"""pass@k against brute force over k-subsets; group summary on a small hand-made batch."""

from __future__ import annotations

from itertools import combinations

import pytest

from opencomposer.rl.metrics import pass_at_k, summarize_groups


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force_for_small_n():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = _brute_pass_at_k(n, c, k)
                assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)


def test_pass_at_k_known_values_and_large_n():
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(5, 0, 5) == 0.0
    # C(2000, 100) overflows a float; the product form does not.
    assert 0.0 < pass_at_k(2000, 1, 100) == pytest.approx(100 / 2000)


@pytest.mark.parametrize("n,c,k", [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_summarize_groups():
    groups = {"t1": [1.0, 0.0, 0.0, 0.0], "t2": [0.0] * 4, "t3": [1.0] * 4}
    s = summarize_groups(groups, k=2)
    assert s["tasks"] == 3 and s["rollouts"] == 12
    assert s["reward_mean"] == pytest.approx((0.25 + 0.0 + 1.0) / 3)
    assert s["pass@1"] == pytest.approx((0.25 + 0.0 + 1.0) / 3)
    assert s["pass@2"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)  # t1: 1 - C(3,2)/C(4,2)
    assert s["uniform_groups"] == pytest.approx(2 / 3)


def test_summarize_groups_threshold_and_errors():
    s = summarize_groups({"t": [0.9, 0.2]}, k=1, pass_threshold=0.5)
    assert s["pass@1"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="'short'.*fewer than k=4"):
        summarize_groups({"short": [1.0, 0.0]}, k=4)


def test_rollout_times_split_an_episode_into_sandbox_policy_tools_and_grading():
    from opencomposer.episode.run import EpisodeResult, Rollout
    from opencomposer.harness.trajectory import Step, Trajectory
    from opencomposer.protocols import RewardResult
    from opencomposer.rl.metrics import rollout_times

    def ro(policy_s: list[float], secs: dict[str, float]) -> Rollout:
        traj = Trajectory(messages=[], steps=[Step(turn=i, text="", policy_seconds=p) for i, p in enumerate(policy_s)])
        res = EpisodeResult("t", traj, RewardResult(reward=0.0, passed=False, details={}), secs)
        return Rollout("t", 0, 0, res)

    rollouts = [ro([1.0, 2.0], {"sandbox": 0.5, "episode": 5.0, "reward": 2.0, "total": 7.5}),
                ro([4.0], {"sandbox": 1.5, "episode": 4.0, "reward": 60.0, "total": 65.5}),
                Rollout("t", 0, 2, None)]  # a failed episode has no times and is not counted
    engine = {"prompt_tokens": 1000, "prefill_tokens_computed": 250, "generated_tokens": 80, "steps": 40,
              "prefill_seconds": 1.5, "decode_seconds": 2.5, "step_seconds": 4.2, "step_cpu_seconds": 1.1,
              "step_runqueue_seconds": 0.7}
    t = rollout_times(rollouts, {"queue_seconds": 3.0, "requests": 6}, engine)
    assert t["episode_s_mean"] == pytest.approx(36.5) and t["episode_s_max"] == 65.5
    assert t["episode_sandbox_s_mean"] == 1.0 and t["episode_reward_s_mean"] == 31.0
    assert t["episode_policy_s_mean"] == 3.5 and t["episode_tools_s_mean"] == 1.0  # (5 - 3) and (4 - 4)
    # the slowest episode (65.5 s), in parts: its grade held the step
    assert (t["episode_max_sandbox_s"], t["episode_max_policy_s"], t["episode_max_tools_s"],
            t["episode_max_reward_s"]) == (1.5, 4.0, 0.0, 60.0)
    assert t["queue_s_mean"] == 0.5 and t["prefix_hit_fraction"] == 0.75
    assert t["engine_prefill_s"] == 1.5 and t["engine_generated_tokens"] == 80
    assert (t["engine_step_s"], t["engine_step_cpu_s"], t["engine_step_runqueue_s"]) == (4.2, 1.1, 0.7)
    assert "engine_prefill_s" not in rollout_times(rollouts, {})  # no built-in engine: no engine figures
