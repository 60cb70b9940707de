"""train/update_profile.profiled: a block under torch.profiler written as a table of ops and a JSON
line of totals; an RL run's [run] profile_steps records those steps' updates.

Run: ``pytest tests/unit/train/test_update_profile.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from opencomposer.config import ConfigError, load_config
from opencomposer.rl.config import RLRunConfig
from opencomposer.rl.run import RLRun
from opencomposer.rl.taskpool import ensure_tasks, split_tasks
from opencomposer.train.update_profile import profiled

from testkit.rl_tasks import write_cfg


def test_a_profiled_block_writes_its_ops_and_totals(tmp_path):
    a, b = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64)
    path = tmp_path / "p" / "step-0001.txt"
    with profiled(path):
        for _ in range(3):
            (a @ b).sum().backward()
    text = path.read_text().splitlines()
    totals = json.loads(text[-1])
    assert totals["device"] == "cpu" and totals["ops"] >= 6 and 0 < totals["self_cpu_s"]
    assert totals["wall_s"] > 0 and totals["self_device_s"] == 0
    assert any("aten::mm" in line for line in text[:-1])  # the matmuls, forward and backward


def test_an_rl_run_profiles_the_steps_it_is_told(tmp_path, toolz_tasks):
    out = tmp_path / "run"
    p = write_cfg(tmp_path, toolz_tasks, out, steps=2, kl=0.0)
    p.write_text(p.read_text() + "profile_steps = [2]\n")  # the [run] table is the last
    cfg = load_config(p, RLRunConfig)
    train, _ = split_tasks(ensure_tasks(cfg.tasks, "local"), cfg.tasks.heldout, cfg.tasks.seed, out)
    rows = RLRun(cfg, train, out).run()
    assert [p.name for p in (out / "profile").iterdir()] == ["step-0002.txt"]
    assert json.loads((out / "profile" / "step-0002.txt").read_text().splitlines()[-1])["ops"] > 0
    # the step's row says where the trainer's time went
    assert all(r["time_update"] + r["time_weights"] <= r["time_train"] + 0.02 for r in rows)
    p.write_text(p.read_text().replace("profile_steps = [2]", "profile_steps = [0]"))
    with pytest.raises(ConfigError, match=r"run.profile_steps: \[0\]: steps count from 1"):
        load_config(p, RLRunConfig)
