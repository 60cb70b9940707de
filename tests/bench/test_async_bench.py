"""``benchmarks/bench_async_rl.py``: the same tiny RL run synchronous and one batch ahead, through
the script (its lines, resuming a finished run from its rows), and the overlap-bound arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testkit.rl_tasks import write_cfg

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_async_rl as B  # noqa: E402


def test_speedups_are_set_against_the_synchronous_runs_overlap_bound():
    rows = [{"time_step": 50.0, "time_rollout": 40.0, "time_train": 10.0}] + \
        [{"time_step": 12.0, "time_rollout": 8.0, "time_train": 4.0}] * 3  # the first step (start-up) is left out
    sync = B.report(0, rows, None)
    assert sync["steps_per_hour"] == 300.0 and sync["mean"]["time_rollout"] == 8.0
    ahead = B.report(1, rows[:1] + [{"time_step": 9.0, "time_rollout": 8.0, "time_train": 4.0}] * 3, 0.9)
    s = B.summary([sync, ahead])
    assert s["overlap_bound"] == 1.5 and s["speedup"] == {0: 1.0, 1: round(400 / 300, 3)}
    assert s["of_bound"][1] == round(round(400 / 300, 3) / 1.5, 3)
    assert "no synchronous run" in B.summary([ahead])["note"]


def test_engine_devices_are_checked_as_the_config_would_be(toolz_tasks, tmp_path):
    cfg = write_cfg(tmp_path, toolz_tasks, tmp_path / "unused", steps=1, kl=0.05, engine="hf")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_async_rl.py"), "--config", str(cfg),
                           "--out", str(tmp_path / "b"), "--tasks", str(toolz_tasks), "--staleness", "0",
                           "--engine-devices", "cuda:1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "rollout.engine_devices places built-in engines" in proc.stderr


def test_gpu_busy_is_counted_per_gpu():
    one, two = B.GpuBusy(sample=False), B.GpuBusy(sample=False)
    assert one.fraction() is None
    for line in ("0, 35", "0, 0", "0, 90", "0, 12"):
        one.add(line + "\n")
    assert one.fraction() == 0.75  # one GPU: one figure
    for line in ("0, 100", "1, 0", "0, 80", "1, 0", "1, 5", "0, [N/A]", "garbage"):
        two.add(line)
    assert two.fraction() == {"0": 1.0, "1": 0.333}  # unreadable lines are skipped


def test_the_script_runs_both_and_reports_a_finished_run_again(toolz_tasks, tmp_path):
    cfg = write_cfg(tmp_path, toolz_tasks, tmp_path / "unused", steps=2, kl=0.05, engine="builtin")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_async_rl.py"), "--config", str(cfg), "--out",
           str(tmp_path / "b"), "--tasks", str(toolz_tasks), "--staleness", "0", "1", "--resume"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    s0, s1, summary = lines
    assert (s0["max_staleness"], s1["max_staleness"]) == (0, 1) and s0["steps"] == s1["steps"] == 2
    assert s0["steps_per_hour"] > 0 and s1["mean"]["staleness_max"] <= 1 and s0["gpu_busy_fraction"] is None
    assert summary["overlap_bound"] >= 1 and set(summary["speedup"]) == {"0", "1"}
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # finished: read back, not rerun
    assert again.returncode == 0 and [json.loads(x) for x in again.stdout.splitlines() if x.startswith("{")][0] == s0
