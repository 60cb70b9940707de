"""Difficulty on demand: which deletion levels to draw, moved up as the policy's pass rate rises.

Levels are ranked by how much code a task removes (``deletion.LEVELS``: line < block < body <
function < class < feature). ``LevelSchedule`` keeps a position on that ladder and turns it
into sampling weights for ``make.make_tasks(levels=...)``: the level at the position gets
the most weight, its neighbours less, every level a small floor so the pool never loses a
kind entirely. The trainer reports its recent pass rate; above ``raise_at`` the position
moves up by ``step``, below ``lower_at`` it moves down::

    sched = LevelSchedule(position=2.0)     # centred on "body"
    sched.update(0.85)                      # -> True, position 2.5: body and function
    make_tasks(src, out, 20, levels=sched.weights())

``TaskFactory.harder(pass_rate)`` (tasks/factory.py) wraps this for the trainer.

Test: ``.venv/bin/python -m pytest tests/unit/tasks/test_difficulty.py``.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from opencomposer.config import Strict
from opencomposer.tasks.deletion import LEVELS

RANK = {lv: i for i, lv in enumerate(LEVELS)}


class LevelSchedule(Strict):
    position: float = Field(2.0, ge=0, le=len(LEVELS) - 1, description="0 = line, 1 = block ... 5 = feature")
    raise_at: float = Field(0.7, gt=0, le=1, description="pass rate at or above which tasks get harder")
    lower_at: float = Field(0.2, ge=0, lt=1, description="pass rate below which tasks get easier")
    step: float = Field(0.5, gt=0, le=len(LEVELS) - 1)
    width: float = Field(1.5, gt=0, description="levels within this distance of position get weight")
    floor: float = Field(0.05, ge=0, le=1, description="weight every level keeps")

    @model_validator(mode="after")
    def _ordered(self) -> LevelSchedule:
        if self.lower_at >= self.raise_at:
            raise ValueError(f"lower_at ({self.lower_at}) must be below raise_at ({self.raise_at})")
        return self

    def weights(self) -> dict[str, float]:
        """Level -> sampling weight, summing to 1: a tent of half-width ``width`` around ``position``."""
        raw = {lv: max(self.floor, 1.0 - abs(RANK[lv] - self.position) / self.width) for lv in LEVELS}
        total = sum(raw.values())
        return {lv: round(w / total, 4) for lv, w in raw.items()}

    def update(self, pass_rate: float) -> bool:
        """Move along the ladder for ``pass_rate`` (0..1); True if the position changed."""
        if not 0.0 <= pass_rate <= 1.0:
            raise ValueError(f"pass_rate must be within 0..1, got {pass_rate!r}")
        old = self.position
        if pass_rate >= self.raise_at:
            self.position = min(len(LEVELS) - 1, self.position + self.step)
        elif pass_rate < self.lower_at:
            self.position = max(0.0, self.position - self.step)
        return self.position != old

    @property
    def level(self) -> str:
        """The level the schedule is centred on."""
        return LEVELS[round(self.position)]


def mean_level(levels: dict[str, int]) -> float:
    """Average rank of made tasks (``MakeReport.levels``): how hard a batch came out."""
    n = sum(levels.values())
    return sum(RANK[lv] * k for lv, k in levels.items()) / n if n else 0.0
