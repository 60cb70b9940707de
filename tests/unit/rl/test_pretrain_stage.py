"""The ``[pretrain]`` table of a run config (``rl/config.py`` ``PretrainStage``): off unless asked
for, and a config that cannot run is refused with the key and the value named, before any task
is made or model loaded. The stage itself runs in ``tests/integration/test_pipeline_pretrain.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from opencomposer.config import ConfigError, load_config
from opencomposer.rl.config import RLRunConfig
from opencomposer.pipeline.run import run_pipeline
from opencomposer.train.config import PretrainRunConfig

ROOT = Path(__file__).resolve().parents[3]


def _cfg(tmp: Path, pretrain: str) -> Path:
    p = tmp / "run.toml"
    p.write_text(f'[tasks]\ndir = "{tmp / "tasks"}"\n[run]\nout_dir = "{tmp / "run"}"\n[pretrain]\n{pretrain}\n')
    return p


@pytest.mark.parametrize("name", ["demo.toml", "learn.toml"])
def test_the_shipped_run_configs_have_the_stage_off(name):
    cfg = load_config(ROOT / "configs" / "train" / name, RLRunConfig)
    assert not cfg.pretrain.enabled
    # a whole dump reads back (the ablation builds its arms so): the stage's defaults are no settings
    assert RLRunConfig.model_validate(cfg.model_dump()) == cfg


def test_the_stage_runs_the_settings_of_opencomposer_pretrain(tmp_path):
    (tmp_path / "code").mkdir()
    cfg = load_config(_cfg(tmp_path, f'enabled = true\ndata = ["{tmp_path / "code"}:2"]\nsteps = 7\n'
                                     '[pretrain.train]\nweight_decay = 0.05'), RLRunConfig)
    run = cfg.pretrain.run_config("tiny-random", "runs/x/pretrain")
    assert isinstance(run, PretrainRunConfig) and run.pretrain.model == "tiny-random"
    assert run.pretrain.out_dir == "runs/x/pretrain" and run.pretrain.steps == 7
    assert run.pretrain.data == [f"{tmp_path / 'code'}:2"] and run.train.weight_decay == 0.05
    # the optimiser defaults are those of `opencomposer pretrain`, not of the RL [train] table
    assert RLRunConfig(tasks={"dir": "t"}).pretrain.train == PretrainRunConfig().train != cfg.train


@pytest.mark.parametrize("table, words", [
    ("enabled = true", ["table 'pretrain'", "pretrain.enabled = true needs pretrain.data"]),
    ('enabled = true\ndata = ["src:-1"]', ["pretrain.data 'src:-1'", "weight '-1' must be a positive number"]),
    ('data = ["src"]\nmodel = "tiny-random"', ["pretrain.model", "[model] name"]),
    ('data = ["src"]\nout_dir = "x"', ["pretrain.out_dir", "<run.out_dir>/pretrain"]),
    ('data = ["src"]\nheld_out = 0.0', ["pretrain.held_out = 0.0"]),
    ('data = ["src"]\n[pretrain.train]\nlr = 1e-3', ["set pretrain.lr instead of pretrain.train.lr"]),
    ('data = ["src"]\nstep = 3', ["pretrain.step", "unknown key"]),
])
def test_a_bad_table_is_refused_at_load_naming_the_key(tmp_path, table, words):
    p = _cfg(tmp_path, table)
    with pytest.raises(ConfigError) as e:
        load_config(p, RLRunConfig)
    for w in [str(p), *words]:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("key", ["data", "eval_data"])
def test_a_missing_path_is_named_before_the_tasks_are_made(tmp_path, key):
    (tmp_path / "code").mkdir()
    paths = {"data": [str(tmp_path / "code")], "eval_data": []}
    paths[key] = paths[key] + [str(tmp_path / "nope") + (":2" if key == "data" else "")]
    cfg = load_config(_cfg(tmp_path, f"enabled = true\ndata = {json.dumps(paths['data'])}\n"
                                     f"eval_data = {json.dumps(paths['eval_data'])}"), RLRunConfig)
    with pytest.raises(ConfigError) as e:
        run_pipeline(cfg, log=lambda m: None)
    assert f"pretrain.{key}: '{paths[key][-1]}': {tmp_path / 'nope'} does not exist" == str(e.value)
    # no tasks (and no [tasks] sources): the pipeline would have failed on them next, had it got there
    assert not (tmp_path / "run" / "split.json").exists()


def test_the_command_line_says_what_is_wrong_in_one_line(tmp_path):
    p = _cfg(tmp_path, f'enabled = true\ndata = ["{tmp_path / "nope"}"]')
    r = subprocess.run([sys.executable, "-m", "opencomposer.cli", "train", "--config", str(p)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["error"] == \
        f"pretrain.data: '{tmp_path / 'nope'}': {tmp_path / 'nope'} does not exist"
