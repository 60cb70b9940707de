"""Run a suite: K episodes per task through the deployment harness, one results file.

    from opencomposer.eval.run import run_suite
    with make_policy("model", model="smollm2-135m", temperature=0.7, batch=8) as pol:   # policies/
        res = run_suite(load_suite("smoke"), pol, k=4, backend="auto", agent_cfg=AgentConfig(),
                        label="smollm2-135m", out_dir=Path("runs/eval/smollm2"))
    res["summary"]["pass@1"], res["summary"]["pass@k"]

``policy`` is either one model behind a ``BatchedPolicy`` (or a plain ``ModelPolicy``, one
episode at a time), whose episodes run concurrently through ``episode.run.collect_rollouts``
exactly as RL rollouts do; or a factory ``task -> Policy`` for per-task policies
(``lambda task: make_policy("oracle", task=task)``, a scripted policy, a fresh ``OpenAIPolicy``
per episode). Either way each episode is ``episode.run.run_task``: its own sandbox, the deployed
``Agent`` loop and the hidden-test reward. An episode that raises counts as a failure (reward 0,
``stop_reason`` ``"error: ..."``, counted in ``summary.episode_errors``), never stops the
suite; when every episode breaks (no sandbox, say) ``run_suite`` raises ``EvalError``.
While the episodes run, stderr shows their progress (``episode/progress.py``: episodes done,
tokens/s, reward so far, elapsed, ETA; a bar on a terminal, else a line every 20 s); the
in-run held-out evaluations (``eval/heldout.py``) show it too, under the label ``eval``.

``out_dir`` receives ``results.json`` (``eval/results.py``, schema ``opencomposer.eval/1``,
written atomically) and every transcript under ``transcripts/<task>-<sample>.json``.

Test: ``pytest tests/unit/eval/test_run.py``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from opencomposer.config import AgentConfig
from opencomposer.eval.results import SCHEMA, EvalError, summarize
from opencomposer.eval.suite import Suite
from opencomposer.policies.model import ModelPolicy
from opencomposer.paths import atomic_write_text
from opencomposer.policies.batched import BatchedPolicy
from opencomposer.episode.run import EpisodeResult, run_task
from opencomposer.episode.run import collect_rollouts, show_progress
from opencomposer.episode.progress import RolloutProgress
from opencomposer.tasks.format import Task

PolicyFactory = Callable[[Task], Any]


@dataclass
class Episode:
    task: Task
    sample: int
    result: EpisodeResult | None
    seconds: float
    error: str = ""


def run_episodes(tasks: list[Task], policy: Any, k: int, backend: str, agent_cfg: AgentConfig,
                 max_concurrent: int | None = None,
                 on_progress: Callable[[int, int], None] | None = None,
                 progress: str | None = "eval") -> list[Episode]:
    """``k`` episodes of every task, in (task, sample) order; see the module docstring.
    ``progress``: the label of the live progress on stderr (``episode/progress.py``; shown on
    rank 0 alone under torchrun), None for none."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    jobs = len(tasks) * k
    from opencomposer.train.distributed import current, shows_progress
    progress = show_progress(progress, shows_progress(current(), True)) if progress else None
    if isinstance(policy, (BatchedPolicy, ModelPolicy)):
        conc = max_concurrent or (min(jobs, policy.max_batch) if isinstance(policy, BatchedPolicy) else 1)
        rollouts = collect_rollouts(tasks, k, policy, backend, agent_cfg, max_concurrent=conc,
                                    on_progress=on_progress, progress=progress)
        return [Episode(tasks[r.group], r.index, r.result, r.seconds, r.error) for r in rollouts]
    if not callable(policy):
        raise TypeError(f"policy must be a BatchedPolicy, a ModelPolicy or a factory task -> Policy; "
                        f"got {type(policy).__name__}")
    done, lock = [0], threading.Lock()
    shown = RolloutProgress(jobs, progress) if progress and jobs else None

    def one(job: tuple[Task, int]) -> Episode:
        task, i = job
        t0 = time.monotonic()
        if shown is not None:
            shown.episode_started()
        on_step = (lambda step: shown.add_tokens(step.completion_tokens)) if shown is not None else None
        try:
            ep = Episode(task, i, run_task(task, policy(task), backend, agent_cfg, on_step=on_step), 0.0)
        except Exception as e:  # noqa: BLE001 -- one broken episode is a failure, never a failed suite
            ep = Episode(task, i, None, 0.0, f"{type(e).__name__}: {e}")
        ep.seconds = time.monotonic() - t0
        if shown is not None:
            shown.episode_done(ep.result.reward.reward if ep.result is not None else 0.0, ep.result is None)
        with lock:
            done[0] += 1
            if on_progress is not None:
                on_progress(done[0], jobs)
        return ep

    with shown if shown is not None else nullcontext(), \
            ThreadPoolExecutor(max_workers=max_concurrent or min(jobs, 2), thread_name_prefix="eval") as pool:
        return list(pool.map(one, [(t, i) for t in tasks for i in range(k)]))


def episode_record(ep: Episode, difficulty: str) -> dict[str, Any]:
    """One ``episodes[]`` entry of the results file."""
    rec: dict[str, Any] = {"task_id": ep.task.id, "difficulty": difficulty, "sample": ep.sample,
                           "reward": 0, "completion_tokens": 0, "prompt_tokens": 0, "tool_calls": 0,
                           "invalid_calls": 0, "seconds": round(ep.seconds, 3), "stop_reason": ""}
    if ep.result is None:
        rec["stop_reason"] = f"error: {ep.error}"[:300]
        return rec
    t = ep.result.trajectory
    rec.update(reward=1 if ep.result.reward.passed else 0, completion_tokens=t.completion_tokens,
               prompt_tokens=t.prompt_tokens, tool_calls=t.tool_calls, invalid_calls=t.invalid_calls,
               turns=t.turns, stop_reason=t.exit_reason or "unknown")
    if ep.result.flags:  # the monitors voided this episode's reward (rl/episode.run_task)
        rec["hacking_flagged"] = sorted(ep.result.flags)
    if t.error:
        rec["error"] = t.error[:300]
    return rec


def run_suite(suite: Suite, policy: Any, *, k: int = 1, backend: str = "auto",
              agent_cfg: AgentConfig | None = None, label: str, out_dir: Path | None = None,
              price_per_mtok: float = 0.0, prompt_price_per_mtok: float | None = None,
              progress: bool = True, max_concurrent: int | None = None) -> dict:
    """Run the suite and return (and, with ``out_dir``, write) its results dict. ``backend``:
    ``auto`` is the strongest isolating sandbox here (``sandbox.resolve_backend``); the
    results record the one that ran."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not label:
        raise ValueError("label must name the model or checkpoint")
    from opencomposer.sandbox import resolve_backend
    backend = resolve_backend(backend)  # an unknown or unusable backend fails here, not as N failed episodes
    agent_cfg = agent_cfg or AgentConfig()
    created = datetime.now(UTC).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    episodes = run_episodes(suite.tasks, policy, k, backend, agent_cfg, max_concurrent,
                            progress=f"eval {suite.name} / {label}" if progress else None)
    wall = time.perf_counter() - t0
    records = [episode_record(ep, suite.difficulty[ep.task.id]) for ep in episodes]
    broken = [ep for ep in episodes if ep.result is None]
    if len(broken) == len(episodes):  # the machinery, not the policy: no score to report
        raise EvalError(f"suite {suite.name!r}: all {len(episodes)} episodes failed before grading "
                        f"(sandbox {backend!r}); first error: {broken[0].error}")
    results = {
        "schema": SCHEMA, "suite": suite.name, "label": label, "k": k, "created": created,
        "summary": {**summarize(records, k, wall_s=wall, price_per_mtok=price_per_mtok,
                                prompt_price_per_mtok=prompt_price_per_mtok), "episode_errors": len(broken)},
        "config": {"backend": backend, "policy": getattr(policy, "name", getattr(policy, "__name__", "")),
                   "suite_origin": suite.origin, "price_per_mtok": price_per_mtok,
                   "prompt_price_per_mtok": price_per_mtok if prompt_price_per_mtok is None else prompt_price_per_mtok,
                   "agent": agent_cfg.model_dump()},
        "episodes": records,
    }
    if out_dir is not None:
        write_results(results, episodes, Path(out_dir))
    return results


def write_results(results: dict, episodes: list[Episode], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    tdir = out_dir / "transcripts"
    tdir.mkdir(exist_ok=True)
    for ep in episodes:
        if ep.result is not None:
            ep.result.trajectory.save(tdir / f"{ep.task.id}-{ep.sample}.json")
    path = out_dir / "results.json"
    atomic_write_text(path, json.dumps(results, indent=1) + "\n")
    return path
