"""The results file's metrics: pass@1 / unbiased pass@k per task, per difficulty, cost."""

from __future__ import annotations

import itertools

import pytest

from opencomposer.eval.results import pass_at_k_curve, per_task, summarize
from opencomposer.rl.metrics import pass_at_k


def ep(task, level, sample, reward, tokens=100, prompt=1000):
    return {"task_id": task, "difficulty": level, "sample": sample, "reward": reward,
            "completion_tokens": tokens, "prompt_tokens": prompt, "tool_calls": 3, "invalid_calls": sample % 2,
            "seconds": 2.0, "stop_reason": "submitted"}


EPISODES = ([ep("a", "body", i, r) for i, r in enumerate([1, 0, 0, 0])]
            + [ep("b", "body", i, 1, tokens=300) for i in range(4)]
            + [ep("c", "function", i, 0) for i in range(4)])


def test_summary():
    s = summarize(EPISODES, k=2, wall_s=12.5, price_per_mtok=10.0, prompt_price_per_mtok=1.0)
    assert s["tasks"] == 3 and s["episodes"] == 12
    assert s["pass@1"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert s["pass@k"] == pytest.approx((pass_at_k(4, 1, 2) + 1 + 0) / 3) and pass_at_k(4, 1, 2) == 0.5
    assert s["per_difficulty"] == {"body": {"pass@1": 0.625, "pass@k": 0.75, "n": 2},
                                   "function": {"pass@1": 0.0, "pass@k": 0.0, "n": 1}}
    assert s["mean_completion_tokens"] == pytest.approx((8 * 100 + 4 * 300) / 12)
    assert s["invalid_calls"] == 0.5 and s["wall_s"] == 12.5
    assert s["cost_usd"] == pytest.approx((2000 * 10 + 12000 * 1) / 1e6)
    with pytest.raises(ValueError, match="k must be >= 1"):
        summarize(EPISODES, k=0, wall_s=1)


def test_curve_and_per_task():
    res = {"k": 4, "episodes": EPISODES}
    curve = pass_at_k_curve(res)
    assert len(curve) == 4 and curve[0] == pytest.approx(1.25 / 3) and curve[-1] == pytest.approx(2 / 3)
    assert all(x <= y for x, y in itertools.pairwise(curve))
    assert per_task(res, "pass@3") == {"a": 0.75, "b": 1.0, "c": 0.0}
    assert per_task(res, "mean_completion_tokens")["b"] == 300
