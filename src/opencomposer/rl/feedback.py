"""Targeted RL with textual feedback (Composer 2.5): hints at failure points, distilled.

    points = detect(traj, cfg)                       # where the rollout went wrong, and a hint
    pairs = distill_pairs(traj, points, tokenizer, tools)
    trainer.distill_backward(pairs, cfg.coef, normalizer)   # added to the GRPO gradient

A *detector* finds turns that went wrong and writes a short hint for each:

* ``invalid_call``: a tool call the harness could not run (unknown tool, unreadable
  JSON, arguments not fitting the schema); the hint says which kind of mistake it was
  and shows the call format with the tools that exist. It does not repeat the bad call:
  a hinted model copies what it sees, so quoting it would make the teacher favour it too
  (measured: with the bad tool name in the hint, the student's probability of that name rose).
* ``no_call``: a turn without any tool call (nothing happens in this harness).
* ``long_message``: a turn of more than ``long_message_tokens`` tokens without a tool call.
* ``lint``: the diff added ruff findings; the hint names the codes, at the last edit.

For each point, the *student* context is the prompt the policy saw at that turn; the
*teacher* context is the same prompt with the hint inserted as a user message right
before the turn. The same model scores the turn's sampled tokens under both; the KL
from the teacher's distribution to the student's at every token of the turn is the loss
(``rl/loss.distill_kl``), so the policy moves toward what it would have done had it
been told, without the hint ever appearing at deployment.

Test: ``pytest tests/unit/rl/test_feedback.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from opencomposer.harness.tools import TOOLS
from opencomposer.harness.trajectory import Trajectory
from opencomposer.models.chat import encode_prompt, render_prompt
from opencomposer.protocols import Message
from opencomposer.rl.config import DETECTORS, FeedbackConfig
from opencomposer.rl.samples import NOT_GENERATED, Sample, turn_contexts

__all__ = ["DETECTORS", "FeedbackConfig", "FeedbackPoint", "detect", "distill_pairs"]


@dataclass
class FeedbackPoint:
    step: int  # index into traj.steps
    kind: str
    hint: str


def _call_format() -> str:
    example = json.dumps({"name": "read_file", "arguments": {"path": "setup.py"}})
    return f"Write each call as <tool_call>{example}</tool_call>; the tools are {', '.join(TOOLS)}."


def _invalid_hint(observation: str) -> str:
    """What was wrong, in general words: quoting the bad call back would make the teacher
    copy it (a hinted model prefers tokens it can see)."""
    if "unknown tool" in observation:
        why = "that tool does not exist."
    elif "could not read your tool call" in observation:
        why = "the call was not valid JSON."
    else:
        first = observation.strip().splitlines()[0] if observation.strip() else ""
        why = f"the arguments did not fit the tool ({first.removeprefix('Error: ')[:160]})."
    return f"Hint: your next tool call must be valid; the last one failed: {why} {_call_format()}"


def detect(traj: Trajectory, cfg: FeedbackConfig) -> list[FeedbackPoint]:
    """The failure points of ``traj`` with their hints, in turn order, at most one per turn."""
    points: dict[int, FeedbackPoint] = {}
    on = set(cfg.detectors)
    for i, step in enumerate(traj.steps):
        if not step.token_ids or step.summary:
            continue  # a turn the policy did not sample cannot be trained on
        bad = next((e for e in step.tool_events if e.invalid), None)
        if "invalid_call" in on and bad is not None:
            points[i] = FeedbackPoint(i, "invalid_call", _invalid_hint(bad.observation))
        elif "no_call" in on and step.no_call:
            points[i] = FeedbackPoint(i, "no_call", "Hint: reply with a tool call; text alone does nothing. "
                                                    + _call_format())
        elif "long_message" in on and not step.tool_events and len(step.token_ids) > cfg.long_message_tokens:
            points[i] = FeedbackPoint(i, "long_message", "Hint: be brief: a sentence or two, then a tool call.")
    lint = traj.meta.get("lint") or {}
    if "lint" in on and lint.get("new_findings"):
        edits = [i for i, s in enumerate(traj.steps)
                 if s.token_ids and any(e.ok and e.name in ("edit_file", "write_file") for e in s.tool_events)]
        if edits and edits[-1] not in points:
            codes = ", ".join(sorted(lint.get("codes", {})))
            points[edits[-1]] = FeedbackPoint(edits[-1], "lint", f"Hint: keep the code clean: avoid lint errors "
                                                                f"({codes}) such as unused imports or `== None`.")
    return [points[i] for i in sorted(points)][: cfg.max_points_per_rollout]


def distill_pairs(traj: Trajectory, points: list[FeedbackPoint], tokenizer: Any,
                  tools: list[dict[str, Any]]) -> list[tuple[Sample, Sample]]:
    """(student, teacher) sequences for each point: the turn's sampled tokens after each context."""
    contexts = turn_contexts(traj)
    pairs = []
    for p in points:
        history, _ = contexts[p.step]
        completion = list(traj.steps[p.step].token_ids)
        student = encode_prompt(tokenizer, render_prompt(tokenizer, history, tools))
        teacher = encode_prompt(tokenizer, render_prompt(tokenizer, history + [Message("user", p.hint)], tools))
        pairs.append((_sample(student, completion, traj.task_id), _sample(teacher, completion, traj.task_id)))
    return pairs


def _sample(prompt: list[int], completion: list[int], task_id: str) -> Sample:
    n = len(prompt) + len(completion)
    return Sample(prompt + completion, [0] * len(prompt) + [1] * len(completion), [0.0] * n, 0.0,
                  [NOT_GENERATED] * n, task_id)
