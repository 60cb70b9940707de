"""The agent loop: one implementation for deployment, evaluation and RL rollouts.

    traj = run_episode(task.instruction, sandbox, policy, AgentConfig())

Each turn: ``policy.act(messages, tools)`` -> assistant message -> every tool call run in
order -> one tool message per call. Control flow is by small exceptions, as in
mini-swe-agent: the submit tool raises ``Submitted``; a spent budget raises
``LimitsExceeded``; a policy that raises becomes ``PolicyFailed``.

Decisions worth knowing:

- A bad call (unknown tool, unreadable JSON, arguments not fitting the schema) gets an
  error observation that says what was wrong and lists the tools; it is counted in
  ``Trajectory.invalid_calls``, never dropped.
- A turn without any tool call does not end the episode (only ``submit`` does, so a
  rollout cannot stop by rambling): it is answered with a nudge user message, recorded
  as a ``no_call`` step and still counts as a turn. ``max_idle_turns`` such turns in a row
  (when set) end the episode as ``idle``.
- A policy that raises ends the episode as ``policy_error``, except when it says its
  context is full (``ContextLengthError``, ``context_length_exceeded``): that is
  ``max_tokens``, like the harness's own token budget.
- Budgets are checked before every policy call: ``max_turns`` policy turns;
  ``max_tokens`` is the size of the conversation (the last turn's prompt + completion +
  the observations added since), i.e. what the next prompt would cost, not a sum over
  turns; ``max_seconds`` of wall clock, which also caps each ``run`` command. A policy
  that reports no token counts is estimated at ``len(text) // 4``.
- ``submit`` ends the episode at once; later calls of that turn are recorded as not run.
- Self-summarisation (``AgentConfig.summarize_at`` > 0): once the conversation passes
  that many tokens, the policy is asked for a summary and the episode continues in a
  fresh segment that starts from it (``harness/summarize.py``); the summary turn counts
  as a turn. ``max_tokens`` then caps each segment, not the whole episode.

Test: ``pytest tests/unit/harness/test_loop.py``.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Callable

from opencomposer.config import AgentConfig
from opencomposer.models.codec import OPEN, parse_tool_calls
from opencomposer.harness.prompt import agent_tools, no_call_nudge, system_prompt as default_system_prompt
from opencomposer.harness.summarize import next_segment, summary_request
from opencomposer.harness.tools import Submitted, execute
from opencomposer.harness.trajectory import Step, ToolEvent, Trajectory
from opencomposer.protocols import ContextLengthError, Message, Policy, PolicyOutput, Sandbox, ToolCall

MIN_COMMAND_SECONDS = 1.0  # a run call near the deadline still gets this long


class LimitsExceeded(Exception):
    """A budget is spent; ``reason`` is the episode's exit_reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class PolicyFailed(Exception):
    """The policy raised instead of answering."""


CHARS_PER_TOKEN = 4  # rough size of a token, for policies that report no counts


def estimate_tokens(text: str) -> int:
    return len(text) // CHARS_PER_TOKEN


def _is_context_overflow(e: Exception) -> bool:
    """A policy that ran out of context: protocols.ContextLengthError, or an OpenAI-style 400.

    Matched by name and error code so the loop needs neither torch nor the openai client.
    """
    return isinstance(e, ContextLengthError) or getattr(e, "code", None) == "context_length_exceeded"


def _mixed_versions(out: PolicyOutput) -> list[int]:
    """The per-token versions of a turn that new weights reached mid-turn (``Step.policy_versions``);
    empty for a turn of one version (``EnginePolicy`` and ``ServerPolicy`` report them per token)."""
    versions = out.policy_versions
    return list(versions) if len(set(versions)) > 1 and len(versions) == len(out.token_ids) else []


def _prose(text: str) -> str:
    """The text of a turn without its tool-call blocks (the calls travel in ``tool_calls``)."""
    return parse_tool_calls(text)[0] if OPEN in text else text


def _message_chars(m: Message) -> int:
    calls = sum(len(c.name) + len(c.raw or json.dumps(c.arguments)) for c in m.tool_calls)
    return len(m.content) + calls


class Agent:
    """Runs episodes of ``policy`` in ``sandbox``; ``on_step`` sees each finished step (for live logs)."""

    def __init__(
        self,
        sandbox: Sandbox,
        policy: Policy,
        cfg: AgentConfig | None = None,
        system_prompt: str | None = None,
        on_step: Callable[[Step], None] | None = None,
    ):
        self.sandbox = sandbox
        self.policy = policy
        self.cfg = cfg or AgentConfig()
        self.system_prompt = system_prompt or default_system_prompt(self.cfg)
        self.tools = agent_tools(self.cfg)
        self.on_step = on_step

    def run(self, instruction: str, task_id: str = "") -> Trajectory:
        traj = Trajectory(
            messages=[Message("system", self.system_prompt), Message("user", instruction)],
            task_id=task_id,
            policy=getattr(self.policy, "name", type(self.policy).__name__),
            tools=[t["function"]["name"] for t in self.tools],
        )
        self._started = time.monotonic()
        self._ids: set[str] = set()
        self._routed_ids: list[int] | None = None  # the last routed turn's prompt + completion (_new_routes)
        try:
            while True:
                self._check_limits(traj)
                if self._should_summarize(traj):
                    self._summarize(traj)
                else:
                    self._step(traj)
        except Submitted as s:
            traj.exit_reason, traj.final_message = "submitted", s.message
        except LimitsExceeded as e:
            traj.exit_reason, traj.error = e.reason, str(e)
        except PolicyFailed as e:
            traj.exit_reason, traj.error = "policy_error", str(e)
        traj.wall_seconds = time.monotonic() - self._started
        return traj

    # ------------------------------------------------------------------ steps

    def _check_limits(self, traj: Trajectory) -> None:
        cfg = self.cfg
        if traj.turns >= cfg.max_turns:
            raise LimitsExceeded("max_turns", f"reached max_turns={cfg.max_turns} without submit")
        if cfg.max_idle_turns and _idle_run(traj) >= cfg.max_idle_turns:
            raise LimitsExceeded("idle", f"{cfg.max_idle_turns} turns in a row without a tool call "
                                         f"(max_idle_turns={cfg.max_idle_turns})")
        if traj.context_tokens >= cfg.max_tokens and not self._should_summarize(traj):
            raise LimitsExceeded("max_tokens", f"conversation is {traj.context_tokens} tokens >= max_tokens={cfg.max_tokens}")
        elapsed = time.monotonic() - self._started
        if elapsed >= cfg.max_seconds:
            raise LimitsExceeded("timeout", f"{elapsed:.1f}s elapsed >= max_seconds={cfg.max_seconds:g}")

    def _query(self, traj: Trajectory) -> tuple[PolicyOutput, float]:
        t0 = time.monotonic()
        try:
            out = self.policy.act(list(traj.messages), self.tools)
        except Exception as e:  # a crashed or unreachable policy ends the episode, recorded
            if _is_context_overflow(e):
                raise LimitsExceeded("max_tokens", f"the policy's context is full: {e}") from e
            raise PolicyFailed(f"{type(e).__name__}: {e}") from e
        return out, time.monotonic() - t0

    def _should_summarize(self, traj: Trajectory) -> bool:
        cfg, segment = self.cfg, len(traj.segments)
        worked = any(s.segment == segment and not s.summary for s in traj.steps)  # no summary of a summary
        return (cfg.summarize_at > 0 and traj.context_tokens >= cfg.summarize_at
                and traj.summaries < cfg.max_summaries and worked)

    def _summarize(self, traj: Trajectory) -> None:
        """Ask for a summary, close the segment, start the next one from the summary."""
        traj.messages.append(summary_request())
        step, out = self._policy_turn(traj)
        step.summary = True
        try:
            prose = _prose(out.text)  # calls in a summary are not run
            traj.messages.append(Message("assistant", prose))
            traj.segments.append(traj.messages)
            traj.messages = next_segment(traj.messages, prose, self.cfg.summary_keep_turns)
            traj.context_tokens = self._estimate_prompt(traj.messages)
        finally:
            if self.on_step is not None:
                self.on_step(step)

    def _policy_turn(self, traj: Trajectory) -> tuple[Step, PolicyOutput]:
        """Query the policy and record the turn as a new step (its tool calls not yet run)."""
        out, seconds = self._query(traj)
        estimated = not (out.prompt_tokens or out.completion_tokens)
        routes, routes_from = self._new_routes(traj, out)
        step = Step(
            turn=traj.turns, text=out.text, policy_seconds=seconds,
            prompt_tokens=out.prompt_tokens or self._estimate_prompt(traj.messages),
            completion_tokens=out.completion_tokens or estimate_tokens(out.text), tokens_estimated=estimated,
            finish_reason=out.finish_reason, token_ids=list(out.token_ids),
            logprobs=list(out.logprobs), policy_version=out.policy_version, segment=len(traj.segments),
            policy_versions=_mixed_versions(out),
            routes=routes, routes_from=routes_from,
        )
        traj.steps.append(step)
        return step, out

    def _new_routes(self, traj: Trajectory, out: PolicyOutput) -> tuple[str, int]:
        """(routes, first token they cover): a MoE turn whose prompt extends the previous turn's
        prompt + completion token for token (``out.prompt_ids``, which ``EnginePolicy`` fills)
        stores only its new tokens' routes; ``rl.samples`` joins them to the previous turn's.
        So a transcript holds each token's routes once instead of once per turn."""
        prompt = out.prompt_ids  # [] from policies that do not report it: routes stored whole
        prev_ids = self._routed_ids  # the previous turn's prompt + completion
        same_segment = bool(traj.steps) and traj.steps[-1].segment == len(traj.segments)
        self._routed_ids = list(prompt) + list(out.token_ids) if out.routes and prompt else None
        if not (out.routes and prompt and prev_ids and same_segment
                and len(prompt) > len(prev_ids) and prompt[:len(prev_ids)] == prev_ids):
            return out.routes, 0
        # imported here: torch is only needed for MoE policies
        from opencomposer.models.moe_replay import routes_after

        start = len(prev_ids) - 1  # the previous request ran all its tokens but the last
        return routes_after(out.routes, start), start

    def _step(self, traj: Trajectory) -> None:
        step, out = self._policy_turn(traj)
        prompt_tokens, completion_tokens = step.prompt_tokens, step.completion_tokens
        calls = self._unique_ids(out, step.turn)
        # Local models write calls inside their text; the message keeps the prose only,
        # since the calls travel in tool_calls (the codec re-renders them).
        prose = _prose(out.text)
        traj.messages.append(Message("assistant", prose, tool_calls=calls))
        before = len(traj.messages)
        try:
            if not calls:
                step.no_call = True
                traj.messages.append(Message("user", no_call_nudge(out.finish_reason == "length", self.cfg)))
            for i, call in enumerate(calls):
                try:
                    outcome = execute(self.sandbox, call, self._cfg_for_now())
                except Submitted:
                    self._record(traj, step, call, "Submitted.", ok=True, seconds=0.0)
                    for rest in calls[i + 1 :]:
                        self._record(traj, step, rest, "Not run: submit ended the episode.", ok=False, seconds=0.0)
                    raise
                self._record(traj, step, call, outcome.observation, outcome.ok, outcome.seconds, outcome.invalid)
        finally:
            added = sum(_message_chars(m) for m in traj.messages[before:])
            traj.context_tokens = prompt_tokens + completion_tokens + added // CHARS_PER_TOKEN
            if self.on_step is not None:
                self.on_step(step)

    def _record(
        self, traj: Trajectory, step: Step, call: ToolCall, observation: str, ok: bool, seconds: float,
        invalid: bool = False,
    ) -> None:
        step.tool_events.append(
            ToolEvent(call.id, call.name, dict(call.arguments), observation, ok, invalid, seconds, call.raw)
        )
        traj.messages.append(Message("tool", observation, tool_call_id=call.id, name=call.name or None))

    # ------------------------------------------------------------------ helpers

    def _unique_ids(self, out: PolicyOutput, turn: int) -> list[ToolCall]:
        """Copies of the calls, each with an id unique in the episode (tool messages answer by id)."""
        calls = []
        for i, call in enumerate(out.tool_calls):
            call_id = call.id if call.id and call.id not in self._ids else f"call_{turn}_{i}"
            self._ids.add(call_id)
            calls.append(replace(call, id=call_id, arguments=dict(call.arguments)))
        return calls

    def _estimate_prompt(self, messages: list[Message]) -> int:
        chars = sum(_message_chars(m) for m in messages) + len(json.dumps(self.tools))
        return chars // CHARS_PER_TOKEN

    def _cfg_for_now(self) -> AgentConfig:
        """The config with ``command_timeout`` cut to the wall clock still left."""
        left = self.cfg.max_seconds - (time.monotonic() - self._started)
        if left >= self.cfg.command_timeout:
            return self.cfg
        return self.cfg.model_copy(update={"command_timeout": max(left, MIN_COMMAND_SECONDS)})


def _idle_run(traj: Trajectory) -> int:
    """Turns without a tool call at the end of ``traj`` (summary turns skipped)."""
    n = 0
    for step in reversed(traj.steps):
        if step.summary:
            continue
        if not step.no_call:
            break
        n += 1
    return n


def run_episode(
    task_instruction: str,
    sandbox: Sandbox,
    policy: Policy,
    cfg: AgentConfig | None = None,
    system_prompt: str | None = None,
    task_id: str = "",
) -> Trajectory:
    """Run one episode to submit or to a spent budget; see the module docstring."""
    return Agent(sandbox, policy, cfg, system_prompt).run(task_instruction, task_id=task_id)
