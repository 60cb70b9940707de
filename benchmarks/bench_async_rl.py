"""Synchronous vs asynchronous RL steps (``[rollout] max_staleness`` 0 and 1), same config.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_async_rl.py --config configs/train/rl-async.toml \
        --out runs/bench-async [--staleness 0 1] [--steps 4]

Runs ``opencomposer train``'s pipeline once per staleness bound into ``OUT/s{N}`` (one task
directory for all, made on first use), then prints one JSON line per run: wall time of the RL
loop, per-step means of step wall time, trainer idle (waiting for a batch), rollout idle (the
engine with nothing to do: training in a synchronous step, the bound when ahead), rollout
and train time, staleness, versions per rollout, reward; and the per-step rows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from opencomposer.config import load_config
from opencomposer.rl.config import RLRunConfig
from opencomposer.pipeline.run import run_pipeline

KEYS = ("time_step", "time_wait_rollouts", "time_rollout_idle", "time_rollout", "time_generate", "time_train",
        "staleness_mean", "staleness_max", "versions_per_rollout", "reward_mean", "shaped_reward_mean",
        "train_tokens", "mean_completion_tokens")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/train/rl-async.toml")
    ap.add_argument("--out", default="runs/bench-async")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=None)
    a = ap.parse_args()
    base = load_config(Path(a.config), RLRunConfig)
    out = Path(a.out)
    for n in a.staleness:
        cfg = base.model_copy(deep=True)
        cfg.tasks.dir = str(out / "tasks")
        cfg.rollout.max_staleness = n
        cfg.run.out_dir = str(out / f"s{n}")
        if a.steps:
            cfg.run.steps = a.steps
        marks: dict[str, float] = {}
        t0 = time.perf_counter()

        def on_step(row: dict) -> None:
            marks.setdefault("first_step", time.perf_counter())
            marks["last_step"] = time.perf_counter()

        run_pipeline(cfg, log=lambda m: None, on_step=on_step)
        rows = [json.loads(l) for l in (Path(cfg.run.out_dir) / "metrics.jsonl").read_text().splitlines()]
        mean = {k: round(sum(r.get(k, 0.0) for r in rows) / len(rows), 3) for k in KEYS}
        print(json.dumps({"max_staleness": n, "steps": len(rows), "pipeline_s": round(time.perf_counter() - t0, 1),
                          "rl_loop_s_after_first_step": round(marks["last_step"] - marks["first_step"], 1),
                          "mean": mean, "rows": [{k: r.get(k) for k in KEYS} for r in rows]}), flush=True)


if __name__ == "__main__":
    main()
