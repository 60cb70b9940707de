"""The shipped realtime config loads; durations parse; the loop's schedule and state survive restarts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from opencomposer.config import ConfigError, load_config
from opencomposer.realtime.config import RealtimeConfig, parse_duration
from opencomposer.realtime.cycle import RealtimeLoop

ROOT = Path(__file__).resolve().parents[3]


def test_shipped_config_loads():
    cfg = load_config(ROOT / "configs" / "realtime" / "realtime.toml", RealtimeConfig)
    assert cfg.model.name == "smollm2-135m" and parse_duration(cfg.run.every) == 5 * 3600
    assert cfg.train.temperature > 0  # completions are trained at the users' sampling temperature


def test_durations():
    assert parse_duration("5h") == 18000 and parse_duration("30m") == 1800 and parse_duration("1.5d") == 129600
    assert parse_duration("90") == 90 and parse_duration(2.5) == 2.5
    for bad in ("soon", "5 hours", "0s", "-1h"):
        with pytest.raises(ConfigError, match="--every"):
            parse_duration(bad, "--every")


def test_bad_keys_name_the_file_and_key(tmp_path):
    f = tmp_path / "rt.toml"
    f.write_text('[logs]\ndir = "x"\n[model]\nname = "tiny-random"\n[gate]\nsuite = "smoke"\ntolerance = -1\n')
    with pytest.raises(ConfigError, match=r"rt.toml.*gate.tolerance"):
        load_config(f, RealtimeConfig)


def test_every_schedules_from_the_last_cycle_and_state_resumes(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    cfg = RealtimeConfig.model_validate({
        "server": {"deploy": False}, "logs": {"dir": str(logs)}, "model": {"name": "tiny-random"},
        "gate": {"suite": "smoke"}, "run": {"out_dir": str(tmp_path / "rt")}})
    rows: list[dict] = []
    t0 = time.time()
    RealtimeLoop(cfg).run(every_s=1.0, once=False, on_cycle=rows.append, max_cycles=2)
    assert [r["outcome"] for r in rows] == ["nothing_to_train"] * 2
    assert "nothing to train on: 0 completions" in rows[0]["reason"]
    assert rows[1]["started_t"] - rows[0]["started_t"] >= 1.0  # the second cycle waited for its slot
    assert time.time() - t0 >= 1.0
    assert rows[1]["since"] == rows[0]["until"]  # an empty window is consumed
    again = RealtimeLoop(cfg)  # a restarted loop continues the numbering and the window
    row = again.cycle()
    assert row["cycle"] == 3 and row["since"] == rows[1]["until"]
    state = json.loads((tmp_path / "rt" / "state.json").read_text())
    assert [c["cycle"] for c in state["cycles"]] == [1, 2, 3] and state["current"] == "tiny-random"
    (tmp_path / "rt" / "state.json").write_text("{half")
    with pytest.raises(ValueError, match="state.json: not valid JSON"):
        RealtimeLoop(cfg)
