"""One task episode: sandbox from the task, the harness loop with a policy, then the reward.

This is the single path used by ``opencomposer agent`` and (batched) by RL rollouts::

    result = run_task(Task.load("tasks/t1"), OraclePolicy(task), backend="namespace")
    result.reward.reward, result.trajectory.counts

Test: ``pytest tests/adversarial`` (every episode graded and monitored), ``pytest tests/integration/test_rl_run.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

from opencomposer.config import AgentConfig
from opencomposer.harness.loop import Agent
from opencomposer.harness.trajectory import Step, Trajectory
from opencomposer.protocols import Policy, RewardResult, Sandbox, SandboxSpec
from opencomposer.grading import collect, grade
from opencomposer.rewards.changes import workspace_changes
from opencomposer.rewards.lint import lint_delta
from opencomposer.rewards.monitors import monitor, void
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks.format import Task


@dataclass
class EpisodeResult:
    task_id: str
    trajectory: Trajectory
    reward: RewardResult
    seconds: dict[str, float]
    flags: dict[str, list[str]] = field(default_factory=dict)  # the monitors' (the reward is voided when any)

    def summary(self) -> dict:
        c = self.trajectory.counts
        return {
            "task": self.task_id, "reward": self.reward.reward, "passed": self.reward.passed,
            "exit_reason": self.trajectory.exit_reason, "turns": c["turns"],
            "tool_calls": c["tool_calls"], "invalid_calls": c["invalid_calls"],
            "f2p_passed": self.reward.details.get("f2p_passed"),
            "p2p_passed": self.reward.details.get("p2p_passed"),
            "hacking_flagged": bool(self.flags), "flags": self.flags,
            "seconds": self.seconds,
        }


def run_task(task: Task, policy: Policy, backend: str = "auto", cfg: AgentConfig | None = None,
             transcript: Path | None = None, on_step: Callable[[Step], None] | None = None,
             sandboxes: Callable[[SandboxSpec], ContextManager[Sandbox]] | None = None) -> EpisodeResult:
    """One episode of ``task``; ``sandboxes`` (e.g. ``BlockingSandboxPool(...).lease`` or a Ray
    cluster's factory) supplies the sandboxes instead of a fresh ``make_sandbox(spec, backend)``.

    The agent works in one sandbox; its changes to the code under test are then graded in
    another, fresh one (``grading/``), and the monitors read the trajectory, the changes and
    the grader's findings: a flagged episode's reward is voided here, for every caller."""
    t0 = time.time()
    open_sandbox = sandboxes or (lambda spec: make_sandbox(spec, backend))
    with open_sandbox(task.sandbox_spec()) as sb:
        t1 = time.time()
        traj = Agent(sb, policy, cfg, on_step=on_step).run(task.instruction, task_id=task.id)
        t2 = time.time()
        # what the agent changed, the lint it added, and what of it reaches the grader
        changes = workspace_changes(task.workspace, sb)
        traj.meta["changes"] = changes.to_dict()
        traj.meta["lint"] = lint_delta(task.workspace, sb, changes).to_dict()
        carry = collect(task.workspace, sb, changes)
    reward = grade(task, carry, open_sandbox)
    t3 = time.time()
    report = monitor(traj, changes, carry=carry, base=task.workspace, grader=reward.details,
                     allowed=task.gold_patch)
    traj.meta["monitor"] = {"flagged": report.flagged, "flags": report.flags}
    if report.flagged:
        reward = void(reward, report)
    traj.meta["reward"] = {"reward": reward.reward, "passed": reward.passed, **reward.details}
    if transcript is not None:
        traj.save(transcript)
    secs = {"sandbox": round(t1 - t0, 3), "episode": round(t2 - t1, 3), "reward": round(t3 - t2, 3),
            "total": round(time.time() - t0, 3)}
    return EpisodeResult(task.id, traj, reward, secs, report.flags)
