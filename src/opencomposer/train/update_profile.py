"""One training update under ``torch.profiler``: where its time goes, op by op.

    with profiled(out / "profile" / "step-0007.txt"):     # [run] profile_steps = [7] in an RL run
        learner.update(batch); learner.weights()

Writes a table of the ops by self device time (CUDA) or self CPU time (no GPU), their counts and
averages, then one JSON line of totals: the block's wall seconds, the ops' self CPU and device
seconds, the number of ops and of those that ran on the device. A block far longer than its device
time spent it on the host (Python, op dispatch, waiting for the interpreter); device time near the
wall means the GPU is the bound. The profiler records every thread's torch ops in the process, so the
ops of rollouts running beside an RL update (their engine's) are in the table too.

Test: ``pytest tests/unit/train/test_update_profile.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from opencomposer.paths import atomic_write_text

ROWS = 40


def _self_device_us(e) -> float:
    # torch renamed self_cuda_time_total to self_device_time_total; read whichever this build has
    return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))


@contextmanager
def profiled(path: Path) -> Iterator[None]:
    """Record the block with torch.profiler and write ``path`` (table + JSON totals) after it."""
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    totals = {
        "wall_s": round(wall, 4),
        "self_cpu_s": round(sum(e.self_cpu_time_total for e in events) / 1e6, 4),
        "self_device_s": round(sum(_self_device_us(e) for e in events) / 1e6, 4),
        "ops": int(sum(e.count for e in events)),
        "ops_on_device": int(sum(e.count for e in events if _self_device_us(e) > 0)) if cuda else 0,
        "device": "cuda" if cuda else "cpu",
    }
    table = events.table(sort_by=sort, row_limit=ROWS)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, f"{table}\n{json.dumps(totals)}\n")
