"""pass@1 (and pass@k) of a policy on held-out tasks, through the deployment harness.

    evaluate(batched_policy, tasks, k=1, backend="namespace", agent_cfg=AgentConfig())

The small in-run version of ``opencomposer eval`` that training's report uses: the same
episodes (``eval/run.run_episodes``) and the same metrics (``eval/results.summarize``),
returned as a flat dict instead of a results file.
"""

from __future__ import annotations

import time
from pathlib import Path

from opencomposer.config import AgentConfig
from opencomposer.eval.results import summarize
from opencomposer.eval.run import episode_record, run_episodes


def evaluate(policy, tasks: list, k: int, backend: str, agent_cfg: AgentConfig,
             save_dir: Path | None = None) -> dict:
    """Run ``k`` episodes per task; ``save_dir`` keeps every transcript for inspection."""
    t0 = time.perf_counter()
    episodes = run_episodes(tasks, policy, k, backend, agent_cfg, max_concurrent=len(tasks) * k)
    if save_dir is not None:
        save_dir.mkdir(parents=True, exist_ok=True)
        for ep in episodes:
            if ep.result is not None:
                ep.result.trajectory.save(save_dir / f"{ep.task.id}-{ep.sample}.json")
    records = [episode_record(ep, ep.task.meta.feature.level) for ep in episodes]
    seconds = time.perf_counter() - t0
    s = summarize(records, k, wall_s=seconds)
    return {"tasks": len(tasks), "k": k, "rollouts": len(records),
            "reward_mean": sum(r["reward"] for r in records) / len(records),
            "pass@1": s["pass@1"], f"pass@{k}": s["pass@k"],
            "mean_completion_tokens": s["mean_completion_tokens"], "invalid_calls": s["invalid_calls"],
            "tool_calls": s["tool_calls"], "seconds": round(seconds, 1)}
