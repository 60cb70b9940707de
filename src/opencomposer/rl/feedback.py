"""Targeted RL with textual feedback (Composer 2.5): hints at failure points, distilled.

    points = detect(traj, cfg)                       # where the rollout went wrong, and a hint
    pairs = distill_pairs(traj, points, tokenizer, tools)
    trainer.distill_backward(pairs, cfg.coef, normalizer)   # added to the GRPO gradient

A *detector* finds turns that went wrong and writes a short hint for each:

* ``invalid_call``: a tool call the harness could not run (unknown tool, unreadable
  JSON, arguments not fitting the schema); the hint says which kind of mistake it was
  and shows the call format (with the list of tools only when the name was the fault,
  keeping the chosen tool when only its JSON was). It does not repeat the bad call:
  a hinted model copies what it sees, so quoting it would make the teacher favour it too
  (measured: with the bad tool name in the hint, the student's probability of that name rose).
* ``no_call``: a turn without any tool call (nothing happens in this harness).
* ``long_message``: a turn of more than ``long_message_tokens`` tokens without a tool call.
* ``lint``: the diff added ruff findings; the hint names the codes, at the last edit.
* ``repeated_call`` (asked for by name): a look-up (read, list, search, lint) made again with the
  same arguments while no edit or command could have changed its answer
  (``rewards.behaviour.repeated_calls``), at the first repeat of its turn.

For each point, the *student* context is the prompt the policy saw at that turn; the
*teacher* context is the same prompt with the hint appended to the last message before
the turn (the tool observation, or the task message at turn 0). Not a new user message:
a model fine-tuned on agent traces has only ever seen a user message at the start of a
task, so a hinted teacher restarted the task (measured in the issue-7 ablation: 94-99% of
later turns reopened with the first turn's words, and the feedback arms collapsed). The
same model scores the turn's sampled tokens under both; the KL from the teacher's
distribution to the student's is the loss (``rl/loss.distill_kl``), so the policy moves
toward what it would have done had it been told, without the hint ever appearing at
deployment.

The KL is taken *at the failure point* only: for a broken call or a linted edit, the
tokens of that ``<tool_call>`` block; for a turn without a call or an over-long message,
the whole turn. Distilling every token of a turn with a broken call made the policy
degenerate (ablation run 3 in benchmarks/RESULTS.md): the hinted teacher rates the words it
was just shown (the tool names) higher everywhere, and the transcripts inspected show the
student writing lists of tool names in its prose turn after turn; 0/32 solved.

Test: ``pytest tests/unit/rl/test_feedback.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from opencomposer.models.codec import TOOL_CALL_BLOCK
from opencomposer.harness.tools import EDIT_TOOLS, TOOLS, offered
from opencomposer.harness.trajectory import Trajectory
from opencomposer.models.chat import encode_prompt, render_prompt
from opencomposer.protocols import Message
from opencomposer.rewards.behaviour import repeated_calls
from opencomposer.rl.config import DETECTORS, FeedbackConfig
from opencomposer.train.samples import NOT_GENERATED, Sample, turn_contexts

__all__ = ["DETECTORS", "FeedbackConfig", "FeedbackPoint", "detect", "distill_pairs"]


@dataclass
class FeedbackPoint:
    step: int  # index into traj.steps
    kind: str
    hint: str
    call: int | None = None  # which <tool_call> block of the turn failed (None: the whole turn)


def _call_format(tool: str = "") -> str:
    """The call syntax, without naming any tool the turn did not choose.

    A hinted model copies what it sees. With an example ``read_file`` call in the hint, the
    teacher preferred reading at a broken ``edit_file`` call, and after one distillation
    update the policy stopped editing (benchmarks/ablation_behaviour.py: step-2 pass@1 on the
    same tasks 0.88 without feedback, 0 with it; p(read_file) at the broken call 0.001 -> 0.48
    after one update). So the tools are listed only where the fault was the name itself
    (``_invalid_hint``): without the list there, the hinted teacher does not prefer real
    names (``tests/unit/rl/test_feedback.py``: p(invalid name) 0.991 -> 0.999 after four
    updates, against a fall with the list). ``tool``, when the turn's only fault was its
    JSON, is the tool it chose, kept so that the teacher fixes the call, not the choice.
    """
    if tool in TOOLS:
        return f'Write the call as <tool_call>{{"name": "{tool}", "arguments": {{...}}}}</tool_call> with valid JSON.'
    # no name in the name's place at all: a placeholder such as "TOOL" is copied too (measured)
    return 'Write each call as <tool_call> with a JSON object of "name" and "arguments".'


def _tool_list(names: list[str]) -> str:
    return f'Write each call as <tool_call> with a JSON object of "name" (one of {", ".join(names)}) and "arguments".'


_NAME = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"([^"]+)"')


def _invalid_hint(observation: str, text: str = "", tools: list[str] | None = None) -> str:
    """What was wrong, in general words: quoting the bad call back would make the teacher
    copy it (a hinted model prefers tokens it can see)."""
    tool = ""
    if "unknown tool" in observation:
        return f"Hint: your next tool call must be valid; the last one failed: that tool does not exist. {_tool_list(tools or offered())}"
    if "could not read your tool call" in observation:
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
    repeats = dict(reversed(repeated_calls(traj))) if "repeated_call" in on else {}  # turn -> its first repeat
    for i, step in enumerate(traj.steps):
        if not step.token_ids or step.summary:
            continue  # a turn the policy did not sample cannot be trained on
        bad = next((k for k, e in enumerate(step.tool_events) if e.invalid), None)
        if "invalid_call" in on and bad is not None:
            points[i] = FeedbackPoint(i, "invalid_call", _invalid_hint(step.tool_events[bad].observation, step.text, traj.tools),
                                      call=bad)
        elif "no_call" in on and step.no_call:
            # no list of tools here: the KL covers the whole turn, and a hinted model copies names it sees
            points[i] = FeedbackPoint(i, "no_call", "Hint: reply with a tool call; text alone does nothing.")
        elif "long_message" in on and not step.tool_events and len(step.token_ids) > cfg.long_message_tokens:
            points[i] = FeedbackPoint(i, "long_message", "Hint: be brief: a sentence or two, then a tool call.")
        elif i in repeats:
            points[i] = FeedbackPoint(i, "repeated_call", "Hint: you already made that call and nothing has changed "
                                                          "since, so its answer is the same: use it and move on.",
                                      call=repeats[i])
    lint = traj.meta.get("lint") or {}
    if "lint" in on and lint.get("new_findings"):
        edits = [(i, k) for i, s in enumerate(traj.steps) if s.token_ids
                 for k, e in enumerate(s.tool_events) if e.ok and e.name in EDIT_TOOLS]
        if edits and edits[-1][0] not in points:
            i, k = edits[-1]
            codes = ", ".join(sorted(lint.get("codes", {})))
            points[i] = FeedbackPoint(i, "lint", f"Hint: keep the code clean: avoid lint errors "
                                                 f"({codes}) such as unused imports or `== None`.", call=k)
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
        mask = point_mask(completion, p.call, tokenizer)
        pairs.append((_sample(student, completion, mask, traj.task_id), _sample(teacher, completion, mask, traj.task_id)))
    return pairs


def point_mask(completion: list[int], call: int | None, tokenizer: Any) -> list[int]:
    """1 on the tokens of the turn's ``call``-th ``<tool_call>`` block (all tokens when
    ``call`` is None or the block cannot be found in the decoded turn), else 0."""
    n = len(completion)
    if call is None:
        return [1] * n
    text = tokenizer.decode(completion)
    blocks = list(TOOL_CALL_BLOCK.finditer(text))
    if call >= len(blocks):
        return [1] * n
    a, b = _token_at(completion, blocks[call].start(), tokenizer), _token_at(completion, blocks[call].end() - 1, tokenizer)
    return [int(a <= i <= b) for i in range(n)]


def _token_at(ids: list[int], char: int, tokenizer: Any) -> int:
    """Index of the token whose decoded text covers character ``char`` of ``decode(ids)``:
    the first i with len(decode(ids[:i + 1])) > char (binary search; decoded length grows with i)."""
    lo, hi = 0, len(ids) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[: mid + 1])) > char:
            hi = mid
        else:
            lo = mid + 1
    return lo


def with_hint(history: list[Message], hint: str) -> list[Message]:
    """``history`` with ``hint`` appended to its last message (a copy; the trajectory is untouched)."""
    if not history:
        raise ValueError("a feedback point needs the context its turn was generated from")
    last = history[-1]
    return history[:-1] + [replace(last, content=f"{last.content}\n\n{hint}")]


def _sample(prompt: list[int], completion: list[int], mask: list[int], task_id: str) -> Sample:
    n = len(prompt) + len(completion)
    return Sample(prompt + completion, [0] * len(prompt) + mask, [0.0] * n, 0.0, [NOT_GENERATED] * n, task_id)
