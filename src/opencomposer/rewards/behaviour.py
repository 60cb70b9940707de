"""Behaviour penalties: broken tool calls, lint the diff added, a long final message,
questions asked instead of working, and look-ups repeated for nothing.

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
* A look-up (``read_file``, ``list_dir``, ``search``, ``lint``) made again with the same
  arguments while nothing could have changed its answer (no edit and no command since the
  first) costs ``repeated_call``, up to ``repeated_max`` (off at 0, the default). Session 36's
  long run drifted so: 80 of 96 validation episodes at update 25 opened with the same ``lint``
  call 2-4 times, a habit no other term cost.

Test: ``pytest tests/unit/rewards/test_shaping.py -k behaviour``.
"""

from __future__ import annotations

import json
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


LOOKUPS = ("read_file", "list_dir", "search", "lint")  # calls whose answer only a change of the files can move


def repeated_calls(traj: Trajectory) -> list[tuple[int, int]]:
    """(turn, call) of each look-up made again with the same arguments since the last edit or
    command (a command may change files too; an invalid call changes nothing)."""
    seen: set[str] = set()
    repeats = []
    for i, s in enumerate(traj.steps):
        for k, e in enumerate(s.tool_events):
            if e.invalid:
                continue
            if e.name in LOOKUPS:
                key = e.name + json.dumps(e.arguments, sort_keys=True, default=str)
                if key in seen:
                    repeats.append((i, k))
                seen.add(key)
            elif e.name in EDIT_TOOLS or e.name == "run":
                seen.clear()
    return repeats


def repeated_lookups(traj: Trajectory) -> int:
    """How many look-ups ``repeated_calls`` finds."""
    return len(repeated_calls(traj))


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
        "repeated_calls": min(cfg.repeated_max, cfg.repeated_call * repeated_lookups(traj)) if cfg.repeated_call else 0.0,
    }
