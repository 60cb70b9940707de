"""Reward shaping settings: the ``[reward]`` table of a run config (every term switchable).

    [reward.length]      nonlinear length penalty (rewards/length.py)
    [reward.behaviour]   invalid calls, lint, final message, clarifying questions (rewards/behaviour.py)
    [reward.monitors]    reward-hacking monitors (rewards/monitors.py)

The final reward of a rollout is ``task reward - length penalty - behaviour penalties -
hacking penalty`` (``rewards/shaping.py``); each term is logged per step.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from opencomposer.config import Strict


class LengthPenaltyConfig(Strict):
    enabled: bool = False
    coef: float = Field(0.2, ge=0, description="penalty at cost == scale")
    scale: float = Field(4000.0, gt=0, description="cost units of a typical solved episode")
    power: float = Field(0.5, gt=0, le=1, description="concavity: penalty = coef * (cost/scale)**power")
    max_penalty: float = Field(0.5, ge=0)
    thinking: float = Field(1.0, ge=0, description="cost per thinking (prose) token")
    output: float = Field(1.0, ge=0, description="cost per tool-call token")
    tool_io: float = Field(0.25, ge=0, description="cost per observation token")
    tool_calls: float = Field(25.0, ge=0, description="cost per tool call")
    turns: float = Field(100.0, ge=0, description="cost per turn (parallel calls in one turn are cheaper)")
    apply_to: Literal["passed", "all"] = Field(
        "passed", description="'passed': only solved rollouts pay (a failure cannot win by being short)")


class BehaviourConfig(Strict):
    enabled: bool = False
    invalid_call: float = Field(0.05, ge=0, description="per broken/invalid tool call")
    invalid_max: float = Field(0.3, ge=0)
    lint: float = Field(0.02, ge=0, description="per ruff finding the diff adds")
    lint_max: float = Field(0.1, ge=0)
    final_message_chars: int = Field(600, ge=1, description="a longer submit message starts to cost")
    final_message: float = Field(0.05, ge=0, description="penalty at twice the length limit")
    question: float = Field(0.0, ge=0, description="cost of asking the user a question")
    question_without_work: float = Field(0.2, ge=0, description="asking instead of changing any file")
    repeated_call: float = Field(0.0, ge=0, description="per look-up call (read, list, search, lint) repeated with the "
                                                        "same arguments while nothing changed since the first; 0: off")
    repeated_max: float = Field(0.2, ge=0)


class MonitorConfig(Strict):
    enabled: bool = True
    penalty: float = Field(1.0, ge=0, description="subtracted per flagged kind of hacking")
    void_reward: bool = Field(True, description="a flagged rollout gets no task reward")


class RewardConfig(Strict):
    length: LengthPenaltyConfig = LengthPenaltyConfig()
    behaviour: BehaviourConfig = BehaviourConfig()
    monitors: MonitorConfig = MonitorConfig()
