"""Configs: strict TOML loading with errors that name the file, the key and the expectation."""

from pathlib import Path

import pytest

from opencomposer.config import AgentRunConfig, ConfigError, load_config


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_loads_values(tmp_path):
    cfg = load_config(write(tmp_path, "[agent]\nmax_turns = 7\n[sandbox]\nbackend = 'namespace'\n"), AgentRunConfig)
    assert cfg.agent.max_turns == 7 and cfg.sandbox.backend == "namespace"


def test_unknown_key_names_file_and_key(tmp_path):
    p = write(tmp_path, "[agent]\nmax_turn = 7\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, AgentRunConfig)
    msg = str(e.value)
    assert str(p) in msg and "agent.max_turn" in msg and "unknown key" in msg


def test_bad_value_says_what_was_expected(tmp_path):
    p = write(tmp_path, "[agent]\nmax_turns = 0\n[sandbox]\nbackend = 'firecracker'\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, AgentRunConfig)
    msg = str(e.value)
    assert "agent.max_turns" in msg and "greater than or equal to 1" in msg and "got 0" in msg
    assert "sandbox.backend" in msg and "'local'" in msg and "'firecracker'" in msg


def test_garbled_and_missing_files(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[agent\nmax_turns = 1"), AgentRunConfig)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml", AgentRunConfig)


def test_every_shipped_config_loads():
    from opencomposer.config import root_model
    root = Path(__file__).resolve().parents[2] / "configs"
    files = sorted(root.glob("*.toml"))
    assert files, "configs/ ships at least one config"
    for f in files:
        load_config(f, root_model(f))


def test_checks_across_keys_name_both(tmp_path):
    from opencomposer.rl.config import RLRunConfig

    p = write(tmp_path, "[tasks]\ndir = 'x'\n[rollout]\nengine = 'builtin'\n[train]\nlora = true\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, RLRunConfig)
    assert "rollout.engine='builtin'" in str(e.value) and "train.lora=true" in str(e.value)
    p = write(tmp_path, "[tasks]\ndir = 'x'\n[rollout]\nengine = 'server'\nbase_url = 'http://h:8000/v1'\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, RLRunConfig)
    assert "rollout.engine='server' needs rollout.base_url" in str(e.value) and "[sync] store" in str(e.value)
    p = write(tmp_path, "[tasks]\ndir = 'x'\n[sync]\nstore = 'w'\n[train]\nlora = true\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, RLRunConfig)
    assert "[sync] with train.lora=true" in str(e.value)
    p = write(tmp_path, "[agent]\nmax_tokens = 4000\nsummarize_at = 4000\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, AgentRunConfig)
    assert "summarize_at=4000 must be below max_tokens=4000" in str(e.value) and "table 'agent'" in str(e.value)
