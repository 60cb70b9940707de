"""The level schedule the trainer drives: weights centred on a level, moved up as the pass
rate rises and down as it falls; bad settings are errors that say what was expected."""

from __future__ import annotations

import pytest

from opencomposer.config import ConfigError, validate
from opencomposer.policies import make_policy
from opencomposer.tasks.difficulty import LevelSchedule, mean_level
from opencomposer.tasks.factory import FactoryConfig, TaskFactory


def test_weights_follow_position() -> None:
    s = LevelSchedule(position=2.0, width=1.0, floor=0.0)
    assert s.weights() == {"line": 0.0, "block": 0.0, "body": 1.0, "function": 0.0, "class": 0.0, "feature": 0.0}
    s = LevelSchedule(position=3.0, width=2.0, floor=0.05)
    w = s.weights()
    assert abs(sum(w.values()) - 1) < 1e-3 and max(w, key=w.get) == "function"
    assert w["body"] == w["class"] > w["block"] == w["feature"] == w["line"] > 0  # the floor
    assert LevelSchedule().level == "body"  # the default centre


def test_update_moves_along_the_ladder() -> None:
    s = LevelSchedule(position=2.0, step=1.0)
    assert s.level == "body"
    assert s.update(0.9) and s.level == "function"
    assert not s.update(0.5) and s.level == "function"  # in between: stay
    assert s.update(0.1) and s.level == "body"
    for _ in range(10):
        s.update(1.0)
    assert s.position == 5 and s.level == "feature"  # capped at the hardest level
    for _ in range(10):
        s.update(0.0)
    assert s.position == 0 and s.level == "line"  # and floored at the easiest
    with pytest.raises(ValueError, match="pass_rate must be within 0..1"):
        s.update(1.5)
    assert mean_level({"block": 1, "feature": 1}) == 3.0 and mean_level({}) == 0.0


def test_bad_schedule_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="lower_at"):
        validate({"lower_at": 0.8, "raise_at": 0.5}, LevelSchedule, "f.toml")
    with pytest.raises(ConfigError, match="f.toml: key 'difficulty.position'"):
        validate({"libraries": [{"spec": "toolz==1.2.0"}], "difficulty": {"position": 9}},
                 FactoryConfig, "f.toml")
    with pytest.raises(ConfigError, match="key 'libraries': required"):
        validate({}, FactoryConfig, "f.toml")


def test_factory_harder_is_the_trainer_hook(tmp_path) -> None:
    cfg = validate({"libraries": [{"spec": "toolz==1.2.0"}],
                    "difficulty": {"position": 2.0, "step": 1.0, "width": 1.0, "floor": 0.0}},
                   FactoryConfig, "f.toml")
    f = TaskFactory(cfg, tmp_path)
    assert f.harder(0.5) == cfg.difficulty.weights()  # no change in the middle band
    w = f.harder(0.95)
    assert w["function"] == 1.0 and f.schedule.level == "function"
    assert cfg.difficulty.position == 2.0  # the config itself is not mutated


def test_cli_factory_config_errors(tmp_path) -> None:
    import subprocess
    import sys
    bad = tmp_path / "factory.toml"
    bad.write_text("[factory]\nmax_per_libary = 3\n[[libraries]]\nspec = 'toolz==1.2.0'\n")
    for args, said in ((["--config", str(bad)], "key 'factory.max_per_libary': unknown key"),
                       ([], "give --source and --out, or --config FILE")):
        r = subprocess.run([sys.executable, "-m", "opencomposer.cli", "tasks", "make", *args],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 2, r.stderr
        assert r.stdout.strip().splitlines()[-1].startswith('{"error"') and said in r.stdout


def test_install_agent_from_config(tmp_path) -> None:
    pytest.importorskip("openai")
    cfg = validate({"libraries": [{"spec": "toolz==1.2.0"}],
                    "install_agent": {"model": "m", "base_url": "http://127.0.0.1:9/v1"}},
                   FactoryConfig, "f.toml")
    agent = make_policy("openai", **cfg.install_agent.model_dump())  # what `tasks make --config` passes in
    assert type(agent).__name__ == "OpenAIPolicy" and agent.model == "m"
    assert TaskFactory(cfg, tmp_path, agent).policy is agent
    with pytest.raises(ConfigError, match=r"\[install_agent\] but no policy was passed"):
        TaskFactory(cfg, tmp_path)  # a configured agent is never dropped silently
    assert TaskFactory(validate({"libraries": [{"spec": "x"}]}, FactoryConfig, "f"), tmp_path).policy is None
