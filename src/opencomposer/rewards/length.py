"""The nonlinear length penalty: a concave function of a weighted cost of the episode.

    cost = w_think*thinking + w_out*output + w_io*tool_io + w_calls*tool_calls + w_turns*turns
    penalty = min(max_penalty, coef * (cost / scale) ** power)       0 < power <= 1

Concave (power < 1): the first tokens spent cost the most, so waste on an easy task is
expensive per token while a hard task that needs a long episode pays little for its
extra length. Turns carry a cost of their own, so the same tool calls made together in
one turn cost less than spread over several turns (a parallel call also re-reads the
context once instead of each time). ``apply_to = "passed"`` (default) charges only
solved rollouts: a failing one cannot raise its advantage by giving up early.

Test: ``pytest tests/unit/rewards/test_shaping.py -k length``.
"""

from __future__ import annotations

from dataclasses import dataclass

from opencomposer.rewards.config import LengthPenaltyConfig


@dataclass
class Usage:
    """What an episode spent (tokens by kind from the sampled ids; calls and turns from the trajectory)."""

    thinking: int = 0
    output: int = 0
    tool_io: int = 0
    tool_calls: int = 0
    turns: int = 0


def length_cost(u: Usage, cfg: LengthPenaltyConfig) -> float:
    return (cfg.thinking * u.thinking + cfg.output * u.output + cfg.tool_io * u.tool_io
            + cfg.tool_calls * u.tool_calls + cfg.turns * u.turns)


def length_penalty(u: Usage, cfg: LengthPenaltyConfig, passed: bool = True) -> float:
    if not cfg.enabled or (cfg.apply_to == "passed" and not passed):
        return 0.0
    return min(cfg.max_penalty, cfg.coef * (length_cost(u, cfg) / cfg.scale) ** cfg.power)
