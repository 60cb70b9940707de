"""How old the tokens a trainer updates on are: staleness and in-flight updates, per batch.

    oldest_version(rollouts)                 # the oldest weights that sampled a token of the batch
    staleness(samples, trainer.version)      # {"staleness_mean", "staleness_max"} over loss tokens
    versions_per_rollout(rollouts)           # > 1: weights changed mid-rollout

Staleness of a token is the trainer's version at the update minus the version that sampled
it: 0 in a synchronous step, up to ``[rollout] max_staleness`` when rollouts run ahead
(``rl/async_rollouts.py``). Per-token versions come from the sampler (``Step.token_versions``).

Test: ``pytest tests/unit/rl/test_staleness.py``.
"""

from __future__ import annotations

from typing import Iterable

from opencomposer.episode.run import Rollout
from opencomposer.train.samples import Sample


def oldest_version(rollouts: Iterable[Rollout]) -> int | None:
    """The oldest policy version among every sampled token of these rollouts (None: no tokens)."""
    return min((r.policy_versions[0] for r in rollouts if r.policy_versions), default=None)


def staleness(samples: Iterable[Sample], version: int) -> dict[str, float]:
    """Mean and max of ``version - sampling version`` over the samples' loss tokens."""
    ages = [version - v for s in samples for v, m in zip(s.policy_version, s.loss_mask) if m]
    return {"staleness_mean": sum(ages) / len(ages) if ages else 0.0, "staleness_max": float(max(ages, default=0))}


def versions_per_rollout(rollouts: Iterable[Rollout]) -> dict[str, float]:
    """How many policy versions a rollout's tokens span: mean and max over rollouts with tokens."""
    spans = [len(r.policy_versions) for r in rollouts if r.policy_versions]
    return {"versions_per_rollout": sum(spans) / len(spans) if spans else 0.0,
            "versions_per_rollout_max": float(max(spans, default=0))}
