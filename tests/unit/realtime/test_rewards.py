"""Per-completion rewards from a window of logs, the window-baseline samples, and the A/B report."""

from __future__ import annotations

import pytest

from opencomposer.inference.server.session_log import LogWindow
from opencomposer.realtime.ab_report import ab_report, percentile
from opencomposer.realtime.classifier import default_classifier
from opencomposer.realtime.config import RewardSection
from opencomposer.realtime.learn import completion_samples
from opencomposer.realtime.rewards import score_window

CFG = RewardSection(kept=1.0, reverted=1.0, dissatisfied=0.5, latency=0.2, latency_budget_s=10.0)


def comp(cid: str, sid: str | None, t: float, latency: float = 1.0, arm: str = "a", n: int = 3,
         temperature: float = 0.7) -> dict:
    return {"type": "completion", "id": cid, "session_id": sid, "t": t, "arm": arm, "checkpoint": f"ck-{arm}",
            "prompt_ids": [5, 6, 7], "token_ids": list(range(10, 10 + n)), "logprobs": [-1.0] * n,
            "latency_s": latency, "temperature": temperature, "policy_version": 3}


def fb(sid: str, kind: str, t: float, text: str | None = None, cid: str | None = None) -> dict:
    return {"type": "feedback", "session_id": sid, "kind": kind, "t": t, "text": text, "completion_id": cid}


def window() -> LogWindow:
    return LogWindow(0, 100, completions=[
        comp("k1", "kept", 1), comp("k2", "kept", 2, latency=20.0),
        comp("r1", "rev", 3), comp("r2", "rev", 8),
        comp("n1", None, 4, latency=5.0),
        comp("b1", "late", 5, arm="b"),
    ], feedback=[
        fb("kept", "edit_kept", 3), fb("kept", "follow_up", 4, "thanks, now add a docstring"),
        fb("rev", "edit_reverted", 6), fb("rev", "follow_up", 7, "still broken, same error as before"),
        fb("late", "follow_up", 2, "you broke everything, revert it"),  # before its completion: not applied
        fb("ghost", "edit_kept", 9),
    ])


def test_the_documented_formula_term_by_term():
    s = score_window(window(), CFG, default_classifier())
    lat = lambda seconds: -0.2 * min(1.0, seconds / 10.0)
    assert s.rewards["k1"] == pytest.approx(1.0 + lat(1.0))
    assert s.rewards["k2"] == pytest.approx(1.0 - 0.2)  # latency term capped at its weight
    assert s.rewards["r1"] == pytest.approx(-1.0 - 0.5 + lat(1.0))  # reverted and a dissatisfied follow-up
    assert s.rewards["r2"] == pytest.approx(lat(1.0))  # after both events
    assert s.rewards["n1"] == pytest.approx(lat(5.0))  # no session: latency only
    assert s.rewards["b1"] == pytest.approx(lat(1.0))
    assert s.terms["r1"] == pytest.approx({"kept": 0.0, "reverted": -1.0, "dissatisfied": -0.5, "latency": lat(1.0)})
    assert s.orphan_feedback == 1
    assert s.sessions["rev"] == {"arm": "a", "completions": 2, "kept": 0, "reverted": 1, "follow_ups": 1,
                                 "dissatisfied": 1}
    assert s.sessions["kept"]["dissatisfied"] == 0 and s.sessions["late"]["dissatisfied"] == 1
    summary = s.summary()
    assert summary["completions"] == 6 and summary["sessions"] == 3 and summary["kept"] == 1


def test_a_completion_id_targets_one_completion():
    w = LogWindow(0, 10, completions=[comp("c1", "s", 1), comp("c2", "s", 2)],
                  feedback=[fb("s", "edit_reverted", 3, cid="c2")])
    s = score_window(w, CFG, default_classifier())
    assert s.terms["c1"]["reverted"] == 0.0 and s.terms["c2"]["reverted"] == -1.0


def test_samples_use_the_logged_tokens_with_window_baseline_advantages():
    w = window()
    w.completions += [comp("hot", "kept", 1.5, temperature=1.0), comp("empty", "kept", 1.6, n=0)]
    bad = comp("mismatch", "kept", 1.7)
    bad["logprobs"] = [-1.0]
    w.completions.append(bad)
    s = score_window(w, CFG, default_classifier())
    samples, skipped = completion_samples(w.completions, s.rewards, temperature=0.7)
    assert skipped == {"other_temperature": 1, "no_tokens": 1, "logprobs_mismatch": 1}
    assert len(samples) == 6
    assert sum(x.advantage for x in samples) == pytest.approx(0.0, abs=1e-9)
    by_reward = sorted(samples, key=lambda x: x.advantage)
    assert by_reward[-1].task_id == "kept" and by_reward[0].task_id == "rev"  # k1 best, r1 worst
    x = samples[0]
    assert x.input_ids == [5, 6, 7, 10, 11, 12] and x.loss_mask == [0, 0, 0, 1, 1, 1]
    assert x.old_logprobs == [0.0, 0.0, 0.0, -1.0, -1.0, -1.0] and x.policy_version[-1] == 3
    newest, skipped = completion_samples(w.completions, s.rewards, 0.7, max_completions=2)
    assert len(newest) == 2 and skipped["over_max_completions"] == 4
    only_b, skipped = completion_samples(w.completions, s.rewards, 0.7, arm="b")
    assert [x.task_id for x in only_b] == ["late"] and skipped["other_arm"] == 8
    assert only_b[0].advantage == 0.0  # a window of one: no baseline to beat
    assert completion_samples([], {}, 0.7) == ([], {})


def test_ab_report_per_arm_with_counts():
    w = window()
    w.completions += [comp("b2", "late", 6, arm="b", latency=3.0), comp("b3", "bsess", 7, arm="b", latency=5.0)]
    w.feedback += [fb("bsess", "edit_kept", 8), fb("bsess", "edit_kept", 8.5), fb("late", "edit_reverted", 9)]
    rep = ab_report(w, default_classifier())
    a, b = rep["arms"]["a"], rep["arms"]["b"]
    assert (a["sessions"], a["completions"], a["edits_kept"], a["edits_reverted"]) == (2, 5, 1, 1)
    assert a["edit_persistence"] == 0.5 and a["follow_ups"] == 2 and a["dissatisfied"] == 1
    assert a["dissatisfied_rate"] == 0.5 and a["checkpoints"] == ["ck-a"]
    assert b["edit_persistence"] == pytest.approx(2 / 3) and b["dissatisfied_rate"] == 1.0
    assert b["latency_p50_s"] == pytest.approx(3.0) and b["latency_p95_s"] == pytest.approx(4.8)
    assert rep["feedback_without_session"] == 1
    assert rep["delta_b_vs_a"]["edit_persistence"] == pytest.approx((2 / 3 - 0.5) / 0.5)
    assert percentile([], 50) is None and percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
