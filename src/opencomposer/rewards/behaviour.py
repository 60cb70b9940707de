"""Behaviour penalties: broken tool calls, lint the diff added, a long final message, and
questions asked instead of working.

    terms = behaviour_terms(traj, lint, changes, cfg)   # {"invalid_calls": 0.1, "lint": 0.0, ...}

* Every invalid tool call (unknown tool, unreadable JSON, arguments not fitting the
  schema) costs ``invalid_call``, up to ``invalid_max``. The calls stay in the
  trajectory as negative examples: their tokens get the rollout's (lowered) advantage.
* New ruff findings in the changed files (``rewards/lint.py``) cost ``lint`` each.
* The submit message is what the user reads: past ``final_message_chars`` it costs, up
  to ``final_message`` at twice the limit.
* A clarifying question (the final message or a turn without tool calls asking the
  user something) costs ``question``; asked without having changed any file, it costs
  ``question_without_work`` as well, so asking cannot be a way to avoid the work.

Test: ``pytest tests/unit/rewards/test_shaping.py -k behaviour``.
"""

from __future__ import annotations

import re

from opencomposer.harness.tools import EDIT_TOOLS
from opencomposer.harness.trajectory import Trajectory
from opencomposer.rewards.changes import Changes
from opencomposer.rewards.config import BehaviourConfig
from opencomposer.rewards.lint import LintResult

ASKS = re.compile(r"\?\s*$|\b(should I|shall I|do you want|would you like|could you (clarify|confirm|tell)"
                  r"|can you (clarify|confirm)|please (clarify|confirm)|which (one|option) do you)\b", re.I | re.M)


def asked_question(traj: Trajectory) -> bool:
    texts = [traj.final_message] + [s.text for s in traj.steps if s.no_call]
    return any(t and ASKS.search(t) for t in texts)


def did_work(traj: Trajectory, changes: Changes | None) -> bool:
    if changes is not None and not changes.error:
        return bool(changes.files)
    return any(e.ok and e.name in EDIT_TOOLS for s in traj.steps for e in s.tool_events)


def behaviour_terms(traj: Trajectory, lint: LintResult | None, changes: Changes | None,
                    cfg: BehaviourConfig) -> dict[str, float]:
    if not cfg.enabled:
        return {}
    over = max(0, len(traj.final_message) - cfg.final_message_chars) / cfg.final_message_chars
    asked = asked_question(traj)
    return {
        "invalid_calls": min(cfg.invalid_max, cfg.invalid_call * traj.invalid_calls),
        "lint": min(cfg.lint_max, cfg.lint * (lint.new_findings if lint else 0)),
        "final_message": cfg.final_message * min(1.0, over),
        "question": (cfg.question + (0.0 if did_work(traj, changes) else cfg.question_without_work)) if asked else 0.0,
    }
