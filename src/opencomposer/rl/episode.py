"""One task episode: sandbox from the task, the harness loop with a policy, then the reward.

This is the single path used by ``opencomposer agent`` and (batched) by RL rollouts::

    result = run_task(Task.load("tasks/t1"), OraclePolicy(task), backend="namespace")
    result.reward.reward, result.trajectory.counts

Test: ``pytest tests/integration/test_agent_cli.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager

from opencomposer.config import AgentConfig
from opencomposer.harness.loop import Agent
from opencomposer.harness.trajectory import Step, Trajectory
from opencomposer.protocols import Policy, RewardResult, Sandbox, SandboxSpec
from opencomposer.rewards.changes import workspace_changes
from opencomposer.rewards.lint import lint_delta
from opencomposer.rewards.tests import grade
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks.format import Task


@dataclass
class EpisodeResult:
    task_id: str
    trajectory: Trajectory
    reward: RewardResult
    seconds: dict[str, float]

    def summary(self) -> dict:
        c = self.trajectory.counts
        return {
            "task": self.task_id, "reward": self.reward.reward, "passed": self.reward.passed,
            "exit_reason": self.trajectory.exit_reason, "turns": c["turns"],
            "tool_calls": c["tool_calls"], "invalid_calls": c["invalid_calls"],
            "f2p_passed": self.reward.details.get("f2p_passed"),
            "p2p_passed": self.reward.details.get("p2p_passed"),
            "seconds": self.seconds,
        }


def run_task(task: Task, policy: Policy, backend: str = "local", cfg: AgentConfig | None = None,
             transcript: Path | None = None, on_step: Callable[[Step], None] | None = None,
             sandboxes: Callable[[SandboxSpec], ContextManager[Sandbox]] | None = None) -> EpisodeResult:
    """One episode of ``task``; ``sandboxes`` (e.g. ``BlockingSandboxPool(...).lease`` or a Ray
    cluster's factory) supplies the sandbox instead of a fresh ``make_sandbox(spec, backend)``."""
    t0 = time.time()
    open_sandbox = sandboxes or (lambda spec: make_sandbox(spec, backend))
    with open_sandbox(task.sandbox_spec()) as sb:
        t1 = time.time()
        traj = Agent(sb, policy, cfg, on_step=on_step).run(task.instruction, task_id=task.id)
        t2 = time.time()
        # what the agent changed, and the lint it added, before the hidden tests go in
        changes = workspace_changes(task.workspace, sb)
        traj.meta["changes"] = changes.to_dict()
        traj.meta["lint"] = lint_delta(task.workspace, sb, changes).to_dict()
        reward = grade(task, sb)
        t3 = time.time()
    traj.meta["reward"] = {"reward": reward.reward, "passed": reward.passed, **reward.details}
    if transcript is not None:
        traj.save(transcript)
    secs = {"sandbox": round(t1 - t0, 3), "episode": round(t2 - t1, 3), "reward": round(t3 - t2, 3),
            "total": round(time.time() - t0, 3)}
    return EpisodeResult(task.id, traj, reward, secs)
