"""Per-arm A/B report from the session logs: edit persistence, dissatisfied follow-ups, latency.

    opencomposer realtime report --log-dir runs/serve-logs [--since 2026-11-26T06:00:00]

The metrics Cursor reports for its real-time RL A/B test, per arm (a session belongs to the
arm that served its completions):

* ``edit_persistence`` = kept / (kept + reverted) edit events, with both counts;
* ``dissatisfied_rate`` = dissatisfied follow-ups / follow-ups (classifier at
  ``threshold``), and ``dissatisfied_per_session`` = dissatisfied follow-ups / sessions;
* ``latency_p50_s`` / ``latency_p95_s`` over completions (server-side, request to last
  token), and completions, sessions, mean completion tokens;
* ``delta_b_vs_a`` with the relative change of each metric, as in "+2.28% edit persistence".

Counts travel with every rate, so a reader sees how little a small test can show.

Test: ``pytest tests/unit/realtime/test_rewards.py -k ab_report``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from opencomposer.inference.server.session_log import LogWindow
from opencomposer.realtime.classifier import FollowupClassifier
from opencomposer.realtime.rewards import classify_feedback


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def ab_report(window: LogWindow, clf: FollowupClassifier, threshold: float = 0.5) -> dict[str, Any]:
    arm_of: dict[str, str] = {}
    comps: dict[str, list[dict]] = defaultdict(list)
    for c in window.completions:
        arm = str(c.get("arm") or "a")
        comps[arm].append(c)
        if c.get("session_id"):
            arm_of.setdefault(c["session_id"], arm)
    fb: dict[str, list[dict]] = defaultdict(list)
    unmatched = 0
    for ev in classify_feedback(window.feedback, clf, threshold):
        arm = arm_of.get(ev["session_id"])
        if arm is None:
            unmatched += 1
        else:
            fb[arm].append(ev)
    arms = {}
    for arm in sorted(set(comps) | set(fb)):
        cs, evs = comps.get(arm, []), fb.get(arm, [])
        kept = sum(e["kind"] == "edit_kept" for e in evs)
        reverted = sum(e["kind"] == "edit_reverted" for e in evs)
        follow = [e for e in evs if e["kind"] == "follow_up"]
        dis = sum(bool(e.get("dissatisfied")) for e in follow)
        sessions = len({c["session_id"] for c in cs if c.get("session_id")})
        lat = [float(c["latency_s"]) for c in cs]
        arms[arm] = {
            "sessions": sessions, "completions": len(cs),
            "checkpoints": sorted({str(c.get("checkpoint")) for c in cs}),
            "edits_kept": kept, "edits_reverted": reverted,
            "edit_persistence": kept / (kept + reverted) if kept + reverted else None,
            "follow_ups": len(follow), "dissatisfied": dis,
            "dissatisfied_rate": dis / len(follow) if follow else None,
            "dissatisfied_per_session": dis / sessions if sessions else None,
            "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
            "mean_completion_tokens": sum(len(c["token_ids"]) for c in cs) / len(cs) if cs else None,
        }
    out: dict[str, Any] = {"arms": arms, "feedback_without_session": unmatched, "threshold": threshold,
                           "since": window.since, "until": window.until, "skipped_lines": len(window.warnings)}
    if "a" in arms and "b" in arms:
        out["delta_b_vs_a"] = {k: _rel(arms["a"][k], arms["b"][k]) for k in
                               ("edit_persistence", "dissatisfied_rate", "latency_p50_s", "latency_p95_s")}
    return out


def _rel(a: float | None, b: float | None) -> float | None:
    """Relative change of b against a (0.0228 = +2.28%); None when undefined."""
    if a is None or b is None or a == 0:
        return None
    return (b - a) / abs(a)
