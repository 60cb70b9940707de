"""Synchronous vs asynchronous RL steps (``[rollout] max_staleness`` 0, 1, 2...), same config.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_async_rl.py --config configs/train/rl-async.toml \
        --out runs/bench-async [--staleness 0 1 2] [--steps 4] [--tasks DIR] [--model M] [--resume] [--deadline-s S]
        [--engine-devices cuda:1 [cuda:0 ...]]   # two GPUs (issue 33): the trainer on the config's device

Runs ``opencomposer train``'s pipeline once per staleness bound into ``OUT/s{N}`` (one task
directory for all: ``--tasks``, or ``OUT/tasks`` made on first use), then prints one JSON line
per run and a summary as the last line.

Per run: per-step means of step wall time, trainer idle (waiting for a batch), rollout idle
(the engine with nothing to do: training in a synchronous step, the bound when ahead), rollout
and train time, staleness, versions per rollout, reward; steps per hour from the steps' wall
times after the first (the first holds the start: model load, engine, the first batch); on GPUs
(``nvidia-smi`` found), the share of 0.5 s samples each GPU was busy during the run (one figure for
one GPU, ``{"0": .., "1": ..}`` for several). ``--engine-devices`` places the rollout engines
(``[rollout] engine_devices``): the trainer on ``cuda:0`` and one engine on ``cuda:1`` is issue 33's
layout; ``cuda:0 cuda:1`` puts a second engine beside the trainer.

Summary: each run's steps per hour over the synchronous run's (``speedup``), the overlap bound
of the synchronous run, ``(T_rollout + T_train) / max(T_rollout, T_train)`` from its means (what
overlapping the two could give at most), and each speed-up's share of that bound (issue 31's
goals: >= 1.25x and >= 80% of the bound on one GPU).

Runs longer than a call: ``--resume`` continues a stopped run from its checkpoint
(``[run] save_every``) and reports a finished one from its rows; ``--deadline-s`` starts no new
run after that many seconds (what ran is reported; call again to go on).

Test: ``pytest tests/bench/test_async_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

from opencomposer.config import ConfigError, load_config, validate
from opencomposer.rl.config import RLRunConfig
from opencomposer.pipeline.run import run_pipeline

KEYS = ("time_step", "time_wait_rollouts", "time_rollout_idle", "time_rollout", "time_generate", "time_train",
        "staleness_mean", "staleness_max", "versions_per_rollout", "reward_mean", "shaped_reward_mean",
        "train_tokens", "mean_completion_tokens")


class GpuBusy:
    """``nvidia-smi``'s utilization of every GPU sampled every 0.5 s in a thread; ``fraction()``: the
    share of samples above 0, one figure for one GPU, ``{index: share}`` for several (None without
    nvidia-smi)."""

    def __init__(self, sample: bool = True) -> None:
        self.samples: dict[str, list[int]] = {}
        self.proc = None
        if sample and shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "500"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.add(line)

    def add(self, line: str) -> None:
        """One line of ``nvidia-smi --query-gpu=index,utilization.gpu --format=csv,noheader,nounits``."""
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            self.samples.setdefault(parts[0], []).append(int(parts[1]))

    def fraction(self) -> float | dict[str, float] | None:
        if self.proc is not None:
            self.proc.terminate()
        busy = {i: round(sum(1 for s in v if s > 0) / len(v), 3) for i, v in sorted(self.samples.items()) if v}
        if not busy:
            return None
        return next(iter(busy.values())) if len(busy) == 1 else busy


def rows_of(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def report(n: int, rows: list[dict], gpu_busy: float | None) -> dict:
    """One run's line (module docstring)."""
    timed = rows[1:] or rows
    mean = {k: round(sum(r.get(k, 0.0) for r in timed) / max(len(timed), 1), 3) for k in KEYS}
    step_s = sum(r.get("time_step", 0.0) for r in timed)
    return {"max_staleness": n, "steps": len(rows), "steps_per_hour": round(3600 * len(timed) / step_s, 1) if step_s else None,
            "gpu_busy_fraction": gpu_busy, "mean": mean, "rows": [{k: r.get(k) for k in KEYS} for r in rows]}


def summary(runs: list[dict]) -> dict:
    """Speed-ups over the synchronous run and their share of its overlap bound."""
    sync = next((r for r in runs if r["max_staleness"] == 0), None)
    out: dict = {"bench": "async_rl", "runs": [r["max_staleness"] for r in runs]}
    if sync is None or not sync["steps_per_hour"]:
        return {**out, "note": "no synchronous run (max_staleness 0) to compare with"}
    t_r, t_t = sync["mean"]["time_rollout"], sync["mean"]["time_train"]
    bound = round((t_r + t_t) / max(t_r, t_t), 3) if max(t_r, t_t) > 0 else None
    out.update({"sync_time_rollout": t_r, "sync_time_train": t_t, "overlap_bound": bound, "speedup": {}, "of_bound": {}})
    for r in runs:
        if r["steps_per_hour"]:
            s = round(r["steps_per_hour"] / sync["steps_per_hour"], 3)
            out["speedup"][r["max_staleness"]] = s
            out["of_bound"][r["max_staleness"]] = round(s / bound, 3) if bound else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/train/rl-async.toml")
    ap.add_argument("--out", default="runs/bench-async")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--tasks", default=None, help="task directory of every run (default: OUT/tasks, made if empty)")
    ap.add_argument("--model", default=None, help="the model every run starts from (default: the config's)")
    ap.add_argument("--resume", action="store_true", help="continue stopped runs, report finished ones")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no run after this many seconds")
    ap.add_argument("--engine-devices", nargs="+", default=None, metavar="DEV",
                    help="[rollout] engine_devices: one built-in engine per device (e.g. cuda:1 beside a trainer on cuda:0)")
    a = ap.parse_args()
    base = load_config(Path(a.config), RLRunConfig)
    if a.engine_devices:
        base.rollout.engine_devices, base.rollout.engines = a.engine_devices, len(a.engine_devices)
        try:  # the section's checks, on the new placement
            base = validate(base.model_dump(), RLRunConfig, f"{a.config} with --engine-devices")
        except ConfigError as e:
            raise SystemExit(str(e)) from None
    out, t_start = Path(a.out), time.monotonic()
    runs = []
    for n in a.staleness:
        cfg = base.model_copy(deep=True)
        cfg.tasks.dir = a.tasks or str(out / "tasks")
        cfg.rollout.max_staleness = n
        if a.model:
            cfg.model.name = a.model
        cfg.run.out_dir = str(out / f"s{n}")
        if a.steps:
            cfg.run.steps = a.steps
        rows = rows_of(Path(cfg.run.out_dir))
        done = len(rows) >= cfg.run.steps
        if not done:
            if a.deadline_s is not None and time.monotonic() - t_start > a.deadline_s:
                print(json.dumps({"max_staleness": n, "skipped": "past --deadline-s; call again"}), flush=True)
                continue
            busy = GpuBusy()
            try:
                run_pipeline(cfg, resume=a.resume, log=lambda m: None)
            finally:
                gpu = busy.fraction()
            rows = rows_of(Path(cfg.run.out_dir))
            (Path(cfg.run.out_dir) / "gpu_busy.json").write_text(json.dumps({"fraction": gpu}))
        else:
            saved = Path(cfg.run.out_dir) / "gpu_busy.json"
            gpu = json.loads(saved.read_text())["fraction"] if saved.exists() else None
        runs.append(report(n, rows, gpu))
        print(json.dumps(runs[-1]), flush=True)
    print(json.dumps(summary(runs)), flush=True)


if __name__ == "__main__":
    main()
