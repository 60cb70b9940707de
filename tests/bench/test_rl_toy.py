"""benchmarks/rl_toy.py: the RL learner on a bandit (tiny-random here; the embedded model in RESULTS): samples
aligned into the learner's ``Sample``s, an update per step, Adam's gradient scale read back, one JSON line last."""

from __future__ import annotations

import json
import math
from testkit.scripts import load_benchmark

toy = load_benchmark("rl_toy")


def test_a_toy_arm_updates_and_reports(capsys, monkeypatch):
    assert toy.reward("The number is 12") == 1.0 and toy.reward("Once upon a time") == 0.0
    # tiny-random's random tokens hold no digit: a reward its answers split on, so every step trains
    monkeypatch.setattr(toy, "reward", lambda text: float(len(text) % 2))
    assert toy.main(["--model", "tiny-random", "--steps", "2", "--k", "4", "--held-k", "2", "--eps", "1e-8"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    steps = [x for x in lines if "step" in x]
    assert [x["step"] for x in steps] == [1, 2]
    last = lines[-1]
    assert last["bench"] == "rl_toy" and len(last["arms"]) == 1
    arm = last["arms"][0]
    assert arm["adam_eps"] == 1e-8 and 0.0 <= arm["held_before"] <= 1.0 and 0.0 <= arm["held_after"] <= 1.0
    assert all(x["samples"] > 0 for x in steps)
    assert math.isfinite(arm["sqrt_v_A"]) and arm["sqrt_v_B"] > 0  # Adam's moments, read back
