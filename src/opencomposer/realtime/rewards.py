"""A window of session logs -> one reward per logged completion.

    scored = score_window(window, RewardSection(), default_classifier())
    scored.rewards            # {completion id: reward}
    scored.sessions           # per session: kept, reverted, follow-ups, dissatisfied, arm

The formula (weights from ``[reward]`` of ``configs/realtime/realtime.toml``), for completion c of
session s::

    r_c = kept * K_s - reverted * R_s - dissatisfied * D_s - latency * min(1, latency_c / latency_budget_s)

* ``K_s`` / ``R_s``: 1 if the session has an ``edit_kept`` / ``edit_reverted`` event at or
  after c (an agent's edits come from the turns before the user judges them), else 0.
  An event with a ``completion_id`` applies to that completion only.
* ``D_s``: 1 if a ``follow_up`` at or after c is dissatisfied (classifier probability >=
  ``threshold``, ``realtime/classifier.py``), else 0. Neutral follow-ups cost nothing.
* The latency term is per completion: a slow answer costs even in a good session.

Every turn of a session shares the session's outcome, as every turn of an RL rollout
shares its final reward (Composer's real-time RL does the same with production
sessions). Completions with no session id get only the latency term. Feedback for
sessions with no completion in the window is counted (``orphan_feedback``), not used.

Test: ``pytest tests/unit/realtime/test_rewards.py``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from opencomposer.inference.server.session_log import LogWindow
from opencomposer.realtime.classifier import FollowupClassifier
from opencomposer.realtime.config import RewardSection


@dataclass
class ScoredWindow:
    rewards: dict[str, float] = field(default_factory=dict)
    terms: dict[str, dict[str, float]] = field(default_factory=dict)  # completion id -> term -> value
    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)
    orphan_feedback: int = 0

    def summary(self) -> dict[str, Any]:
        r = list(self.rewards.values())
        return {"completions": len(r), "sessions": len(self.sessions), "orphan_feedback": self.orphan_feedback,
                "reward_mean": sum(r) / len(r) if r else 0.0, "reward_min": min(r, default=0.0),
                "reward_max": max(r, default=0.0),
                "kept": sum(s["kept"] for s in self.sessions.values()),
                "reverted": sum(s["reverted"] for s in self.sessions.values()),
                "follow_ups": sum(s["follow_ups"] for s in self.sessions.values()),
                "dissatisfied": sum(s["dissatisfied"] for s in self.sessions.values())}


def classify_feedback(feedback: list[dict], clf: FollowupClassifier, threshold: float) -> list[dict]:
    """Each feedback record, with ``dissatisfied`` (bool) and ``p_dissatisfied`` for follow-ups."""
    out = []
    for ev in feedback:
        ev = dict(ev)
        if ev["kind"] == "follow_up":
            ev["p_dissatisfied"] = clf.prob(str(ev.get("text") or ""))
            ev["dissatisfied"] = ev["p_dissatisfied"] >= threshold
        out.append(ev)
    return out


def score_window(window: LogWindow, cfg: RewardSection, clf: FollowupClassifier) -> ScoredWindow:
    by_session: dict[str | None, list[dict]] = defaultdict(list)
    for c in window.completions:
        by_session[c.get("session_id")].append(c)
    events: dict[str, list[dict]] = defaultdict(list)
    out = ScoredWindow()
    for ev in classify_feedback(window.feedback, clf, cfg.threshold):
        if ev["session_id"] in by_session:
            events[ev["session_id"]].append(ev)
        else:
            out.orphan_feedback += 1
    for sid, completions in by_session.items():
        evs = events.get(sid, []) if sid is not None else []
        if sid is not None:
            out.sessions[sid] = {
                "arm": completions[0].get("arm"), "completions": len(completions),
                "kept": sum(e["kind"] == "edit_kept" for e in evs),
                "reverted": sum(e["kind"] == "edit_reverted" for e in evs),
                "follow_ups": sum(e["kind"] == "follow_up" for e in evs),
                "dissatisfied": sum(bool(e.get("dissatisfied")) for e in evs),
            }
        for c in completions:
            later = [e for e in evs if e["t"] >= c["t"] and e.get("completion_id") in (None, c["id"])]
            k = float(any(e["kind"] == "edit_kept" for e in later))
            rv = float(any(e["kind"] == "edit_reverted" for e in later))
            d = float(any(e.get("dissatisfied") for e in later))
            lat = min(1.0, float(c["latency_s"]) / cfg.latency_budget_s)
            terms = {"kept": cfg.kept * k, "reverted": -cfg.reverted * rv, "dissatisfied": -cfg.dissatisfied * d,
                     "latency": -cfg.latency * lat}
            out.terms[c["id"]] = terms
            out.rewards[c["id"]] = sum(terms.values())
    return out
