"""Staleness and versions per rollout, from per-token policy versions of real data structures."""

from opencomposer.harness.trajectory import Step, Trajectory
from opencomposer.protocols import RewardResult
from opencomposer.episode.run import EpisodeResult
from opencomposer.episode.run import Rollout, versions_of
from opencomposer.train.samples import NOT_GENERATED, Sample
from opencomposer.rl.staleness import oldest_version, staleness, versions_per_rollout


def rollout(*steps: Step) -> Rollout:
    traj = Trajectory(messages=[], steps=list(steps))  # as collect_rollouts makes one
    return Rollout("t", 0, 0, EpisodeResult("t", traj, RewardResult(0.0, False), {}), policy_versions=versions_of(traj))


def test_a_turn_updated_mid_way_keeps_each_tokens_version():
    one = Step(turn=0, text="", token_ids=[5, 6, 7], logprobs=[0.0] * 3, policy_version=4)
    mixed = Step(turn=1, text="", token_ids=[5, 6, 7], logprobs=[0.0] * 3, policy_version=4, policy_versions=[4, 4, 5])
    assert one.token_versions() == [4, 4, 4] and mixed.token_versions() == [4, 4, 5]
    assert Step(turn=0, text="no ids (an API policy)").token_versions() == []
    rollouts = [rollout(one), rollout(one, mixed), rollout(), Rollout("t", 0, 1, None)]  # + empty and failed
    assert oldest_version(rollouts) == 4 and oldest_version(rollouts[2:]) is None
    assert versions_per_rollout(rollouts) == {"versions_per_rollout": 1.5, "versions_per_rollout_max": 2.0}


def test_staleness_counts_loss_tokens_only():
    g = NOT_GENERATED
    a = Sample([1, 2, 3, 4], [0, 1, 1, 0], [0.0] * 4, policy_version=[g, 3, 4, g])
    b = Sample([1, 2, 3], [0, 1, 1], [0.0] * 3, policy_version=[g, 4, 4])
    assert staleness([a, b], 4) == {"staleness_mean": 0.25, "staleness_max": 1.0}
    assert staleness([], 4) == {"staleness_mean": 0.0, "staleness_max": 0.0}
