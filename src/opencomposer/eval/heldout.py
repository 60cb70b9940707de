"""pass@1 (and pass@k) of a policy on held-out tasks, through the deployment harness.

    evaluate(batched_policy, tasks, k=1, backend="namespace", agent_cfg=AgentConfig())

Each task gets ``k`` episodes; pass@1 is the unbiased estimate (mean success), pass@k
the unbiased estimator over the k samples. The full CursorBench-style suite comes with
``opencomposer eval``; this is the small in-run version the training report uses.
"""

from __future__ import annotations

import time
from pathlib import Path

from opencomposer.config import AgentConfig
from opencomposer.rl.metrics import summarize_groups
from opencomposer.rl.rollout import collect_rollouts


def evaluate(policy, tasks: list, k: int, backend: str, agent_cfg: AgentConfig,
             save_dir: Path | None = None) -> dict:
    """Run ``k`` episodes per task; ``save_dir`` keeps every transcript for inspection."""
    t0 = time.perf_counter()
    rollouts = collect_rollouts(tasks, k, policy, backend, agent_cfg, max_concurrent=len(tasks) * k)
    if save_dir is not None:
        save_dir.mkdir(parents=True, exist_ok=True)
        for r in rollouts:
            if r.result is not None:
                r.result.trajectory.save(save_dir / f"{r.task_id}-{r.index}.json")
    groups: dict[str, list[float]] = {}
    for r in rollouts:
        groups.setdefault(r.task_id, []).append(r.reward)
    trajs = [r.result.trajectory for r in rollouts if r.result is not None]
    n = max(len(rollouts), 1)
    return {
        **summarize_groups(groups, k),
        "tasks": len(tasks), "k": k,
        "mean_completion_tokens": sum(t.completion_tokens for t in trajs) / n,
        "invalid_calls": sum(t.invalid_calls for t in trajs) / n,
        "tool_calls": sum(t.tool_calls for t in trajs) / n,
        "seconds": round(time.perf_counter() - t0, 1),
    }
