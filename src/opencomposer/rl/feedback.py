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
*teacher* context is the same prompt with the hint appended to the last message before
the turn (the tool observation, or the task message at turn 0). Not a new user message:
a model fine-tuned on agent traces has only ever seen a user message at the start of a
task, so a hinted teacher restarted the task (measured in the issue-7 ablation: 94-99% of
later turns reopened with the first turn's words, and the feedback arms collapsed). The same model scores the turn's sampled tokens under both; the KL
from the teacher's distribution to the student's at every token of the turn is the loss
(``rl/loss.distill_kl``), so the policy moves toward what it would have done had it
been told, without the hint ever appearing at deployment.

Test: ``pytest tests/unit/rl/test_feedback.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
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


def _call_format(tool: str = "") -> str:
    """The call syntax without a concrete call of some other tool.

    A hinted model copies what it sees: with an example ``read_file`` call in the hint, the
    teacher preferred reading at a broken ``edit_file`` call, and after one distillation
    update the policy stopped editing (benchmarks/ablation_behaviour.py: step-2 pass@1 on the
    same tasks 0.88 without feedback, 0 with it; p(read_file) at the broken call 0.001 -> 0.48
    after one update). ``tool``, when the turn's only fault was its JSON, is the tool it chose,
    kept in the template so the teacher fixes the call, not the choice.
    """
    tools = ", ".join(TOOLS)
    if tool in TOOLS:
        return (f'Write the call as <tool_call>{{"name": "{tool}", "arguments": {{...}}}}</tool_call> with valid JSON; '
                f"the tools are {tools}.")
    # no name in the name's place at all: a placeholder such as "TOOL" is copied too (measured)
    return f'Write each call as <tool_call> with a JSON object of "name" (one of {tools}) and "arguments".'


_NAME = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"([^"]+)"')


def _invalid_hint(observation: str, text: str = "") -> str:
    """What was wrong, in general words: quoting the bad call back would make the teacher
    copy it (a hinted model prefers tokens it can see)."""
    tool = ""
    if "unknown tool" in observation:
        why = "that tool does not exist."
    elif "could not read your tool call" in observation:
        why = "the call was not valid JSON (in a JSON string, write a newline as \\n and a quote as \\\")."
        chosen = _NAME.findall(text)  # the right tool, badly written: keep it
        tool = chosen[-1] if chosen else ""
    else:
        first = observation.strip().splitlines()[0] if observation.strip() else ""
        why = f"the arguments did not fit the tool ({first.removeprefix('Error: ')[:160]})."
    return f"Hint: your next tool call must be valid; the last one failed: {why} {_call_format(tool)}"


def detect(traj: Trajectory, cfg: FeedbackConfig) -> list[FeedbackPoint]:
    """The failure points of ``traj`` with their hints, in turn order, at most one per turn."""
    points: dict[int, FeedbackPoint] = {}
    on = set(cfg.detectors)
    for i, step in enumerate(traj.steps):
        if not step.token_ids or step.summary:
            continue  # a turn the policy did not sample cannot be trained on
        bad = next((e for e in step.tool_events if e.invalid), None)
        if "invalid_call" in on and bad is not None:
            points[i] = FeedbackPoint(i, "invalid_call", _invalid_hint(bad.observation, step.text))
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
        teacher = encode_prompt(tokenizer, render_prompt(tokenizer, with_hint(history, p.hint), tools))
        pairs.append((_sample(student, completion, traj.task_id), _sample(teacher, completion, traj.task_id)))
    return pairs


def with_hint(history: list[Message], hint: str) -> list[Message]:
    """``history`` with ``hint`` appended to its last message (a copy; the trajectory is untouched)."""
    if not history:
        raise ValueError("a feedback point needs the context its turn was generated from")
    last = history[-1]
    return history[:-1] + [replace(last, content=f"{last.content}\n\n{hint}")]


def _sample(prompt: list[int], completion: list[int], task_id: str) -> Sample:
    n = len(prompt) + len(completion)
    return Sample(prompt + completion, [0] * len(prompt) + [1] * len(completion), [0.0] * n, 0.0,
                  [NOT_GENERATED] * n, task_id)
