"""The record of one episode: every message, tool call, observation and timing, as JSON.

A ``Trajectory`` is what the harness loop returns and what rewards, RL and evaluation
read. ``steps`` hold one ``Step`` per policy turn: the raw text, the tool calls with
their observations, timings, token counts, and the RL fields a local-model policy fills
(token ids, sampler logprobs, policy version). Counts are derived from the steps, so
they cannot disagree with them. ``save`` writes atomically (temp file + rename), so a
reader never sees half a transcript; ``load`` reads it back.

Test: ``pytest tests/unit/harness/test_loop.py -k transcript``.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opencomposer.protocols import Message, ToolCall

TRAJECTORY_FORMAT = "opencomposer.trajectory/1"
EXIT_REASONS = ("submitted", "max_turns", "max_tokens", "timeout", "idle", "policy_error")


@dataclass
class ToolEvent:
    """One tool call of a turn and what came of it."""

    id: str
    name: str
    arguments: dict[str, Any]
    observation: str
    ok: bool
    invalid: bool = False  # unknown tool, unreadable call or arguments not fitting the schema
    seconds: float = 0.0
    raw: str = ""  # the call's text when it could not be parsed


@dataclass
class Step:
    """One policy turn."""

    turn: int
    text: str
    tool_events: list[ToolEvent] = field(default_factory=list)
    no_call: bool = False  # the turn made no tool call and was answered with a nudge
    policy_seconds: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tokens_estimated: bool = False  # the policy reported no counts; len(text) // 4 was used
    finish_reason: str = "stop"
    # RL fields, straight from PolicyOutput (empty for policies that do not sample tokens)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_version: int = 0
    # per completion token, only when the turn spans several versions (weights updated in
    # flight mid-turn); empty means every token is ``policy_version``'s, as transcripts were
    policy_versions: list[int] = field(default_factory=list)
    segment: int = 0  # which context segment the turn belongs to (see harness/summarize.py)
    summary: bool = False  # the turn answered the summary request; its text is the summary
    # MoE: the experts of the turn's prompt + completion tokens from ``routes_from`` on (the
    # earlier ones are the previous turn's: see ``harness.loop``; ``models.moe_replay`` encoding)
    routes: str = ""
    routes_from: int = 0

    def token_versions(self) -> list[int]:
        """The policy version of each sampled token (several when new weights came in flight
        mid-turn: ``policy_versions``; else every token is ``policy_version``'s)."""
        if self.policy_versions and len(self.policy_versions) == len(self.token_ids):
            return list(self.policy_versions)
        return [self.policy_version] * len(self.token_ids)


@dataclass
class Trajectory:
    messages: list[Message]
    steps: list[Step] = field(default_factory=list)
    exit_reason: str = ""  # one of EXIT_REASONS once the episode is over
    final_message: str = ""  # the submit message
    error: str = ""  # what went wrong, for exit_reason == "policy_error"
    wall_seconds: float = 0.0
    context_tokens: int = 0  # size of the conversation after the last turn
    task_id: str = ""
    policy: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    # messages of the earlier context segments, each ending with the summary request and
    # the summary; ``messages`` is the last (live) segment
    segments: list[list[Message]] = field(default_factory=list)
    # the names of the tools the episode was offered (AgentConfig.edit_tools decides the edit
    # tools); empty in transcripts from before the setting, which had the default set
    tools: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ counts

    @property
    def turns(self) -> int:
        return len(self.steps)

    @property
    def tool_calls(self) -> int:
        return sum(len(s.tool_events) for s in self.steps)

    @property
    def invalid_calls(self) -> int:
        return sum(e.invalid for s in self.steps for e in s.tool_events)

    @property
    def failed_calls(self) -> int:
        """Valid calls whose tool reported an error (missing file, ambiguous edit, ...)."""
        return sum(not e.ok and not e.invalid for s in self.steps for e in s.tool_events)

    @property
    def summaries(self) -> int:
        return sum(s.summary for s in self.steps)

    @property
    def no_call_turns(self) -> int:
        return sum(s.no_call for s in self.steps)

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.steps)

    @property
    def completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.steps)

    @property
    def submitted(self) -> bool:
        return self.exit_reason == "submitted"

    @property
    def counts(self) -> dict[str, int]:
        names = ("turns", "tool_calls", "invalid_calls", "failed_calls", "no_call_turns",
                 "summaries", "prompt_tokens", "completion_tokens")
        return {n: getattr(self, n) for n in names}

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {"format": TRAJECTORY_FORMAT, "counts": self.counts, **d}

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    def save(self, path: str | Path) -> Path:
        """Write the JSON transcript atomically: a temp file in the same dir, then rename."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.to_json())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
        if d.get("format") != TRAJECTORY_FORMAT:
            raise ValueError(f"not a trajectory: format is {d.get('format')!r}, expected {TRAJECTORY_FORMAT!r}")
        d = {k: v for k, v in d.items() if k not in ("format", "counts")}
        d["messages"] = _messages(d["messages"])
        d["segments"] = [_messages(seg) for seg in d.get("segments", [])]
        d["steps"] = [
            Step(**{**s, "tool_events": [ToolEvent(**e) for e in s.get("tool_events", [])]})
            for s in d["steps"]
        ]
        return cls(**d)

    def all_segments(self) -> list[list[Message]]:
        """Every segment's messages in order, the live one last."""
        return [*self.segments, self.messages]

    @classmethod
    def load(cls, path: str | Path) -> "Trajectory":
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (json.JSONDecodeError, TypeError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: not a readable trajectory: {e}") from None


def _messages(raw: list[dict[str, Any]]) -> list[Message]:
    return [Message(**{**m, "tool_calls": [ToolCall(**c) for c in m.get("tool_calls", [])]}) for m in raw]
