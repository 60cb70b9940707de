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


def test_a_config_at_its_old_path_says_where_configs_went(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "configs" / "demo.toml", AgentRunConfig)
    assert "config file not found" in str(e.value) and "configs/<command>/NAME.toml" in str(e.value)


def test_every_shipped_config_loads():
    from opencomposer.cli.configs import ROOTS, root_model
    root = Path(__file__).resolve().parents[2] / "configs"
    files = sorted(f for folder in ROOTS for f in (root / folder).glob("*.toml"))
    assert files, "configs/ ships at least one config"
    for f in files:
        load_config(f, root_model(f))


def test_checks_across_keys_name_both(tmp_path):
    from opencomposer.rl.config import RLRunConfig

    # LoRA with the built-in engine takes merged weights, between steps or (ahead of the trainer) in flight
    p = write(tmp_path, "[tasks]\ndir = 'x'\n[rollout]\nengine = 'builtin'\nmax_staleness = 1\n[train]\nlora = true\n")
    assert load_config(p, RLRunConfig).train.lora
    # LoRA with a vLLM server (full weights only) is refused, naming both keys
    p = write(tmp_path, "[tasks]\ndir = 'x'\n[rollout]\nengine = 'vllm'\nbase_url = 'http://h:8000/v1'\n[train]\nlora = true\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, RLRunConfig)
    assert "rollout.engine='vllm'" in str(e.value) and "train.lora=true" in str(e.value)
    p = write(tmp_path, "[tasks]\ndir = 'x'\n[rollout]\nengine = 'server'\nbase_url = 'http://h:8000/v1'\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, RLRunConfig)
    assert "rollout.engine='server' needs rollout.base_url" in str(e.value) and "[sync] store" in str(e.value)
    # LoRA publishing to a weight store: its followers get whole weights, the adapters merged
    p = write(tmp_path, "[tasks]\ndir = 'x'\n[sync]\nstore = 'w'\n[train]\nlora = true\n")
    assert load_config(p, RLRunConfig).sync.store == "w"
    p = write(tmp_path, "[agent]\nmax_tokens = 4000\nsummarize_at = 4000\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, AgentRunConfig)
    assert "summarize_at=4000 must be below max_tokens=4000" in str(e.value) and "table 'agent'" in str(e.value)


def test_the_root_model_is_the_folders():
    from opencomposer.cli.configs import root_model
    from opencomposer.realtime.config import RealtimeConfig
    from opencomposer.rl.config import RLRunConfig

    assert root_model("configs/train/demo.toml") is RLRunConfig
    assert root_model("configs/realtime/anything.toml") is RealtimeConfig
    assert root_model("configs/agent/agent-demo.toml") is AgentRunConfig
    with pytest.raises(ConfigError, match=r"demo.toml: no root config for folder 'configs'.*configs/<command>/"):
        root_model("configs/demo.toml")


def test_one_loss_section_maps_onto_the_loss():
    """``[loss]`` of every root is ``config.LossSection``: its keys are ``LossConfig``'s (less the
    per-batch normalizer), with the same defaults, and build it."""
    import dataclasses

    from opencomposer.config import LossSection
    from opencomposer.realtime.config import RealtimeConfig
    from opencomposer.rl.config import RLRunConfig
    from opencomposer.train.loss import LossConfig

    fields = {f.name: f.default for f in dataclasses.fields(LossConfig)}
    assert set(LossSection.model_fields) == set(fields) - {"normalizer"}
    assert all(LossSection.model_fields[k].default == fields[k] for k in LossSection.model_fields)
    for root in (RLRunConfig, RealtimeConfig):
        assert issubclass(root.model_fields["loss"].annotation, LossSection)
    rl = RLRunConfig.model_validate({"tasks": {"dir": "t"}, "loss": {"clip_high": 0.3, "kl_coef": 0.1,
                                                                     "std_normalize": True}})
    assert LossConfig(**rl.loss.loss_kwargs()) == LossConfig(clip_high=0.3, kl_coef=0.1)
    rl = RLRunConfig.model_validate({"tasks": {"dir": "t"}, "loss": {"is_correction": "mask", "is_level": "sequence"}})
    assert LossConfig(**rl.loss.loss_kwargs()) == LossConfig(is_correction="mask", is_level="sequence")


def test_a_bad_importance_level_names_the_key_and_the_choices(tmp_path):
    from opencomposer.rl.config import RLRunConfig

    p = write(tmp_path, "[tasks]\ndir = 't'\n[loss]\nis_correction = 'truncate'\nis_level = 'segment'\n")
    with pytest.raises(ConfigError, match=r"c.toml: key 'loss.is_level': input should be 'token' or 'sequence', "
                                          r"got 'segment'"):
        load_config(p, RLRunConfig)


def test_rollout_and_gate_share_one_sampling_section(tmp_path):
    from opencomposer.config import ModelSection, SamplingSection
    from opencomposer.realtime.config import GateSection, RealtimeConfig
    from opencomposer.rl.config import RLRunConfig, RolloutSection

    assert issubclass(RolloutSection, SamplingSection) and issubclass(GateSection, SamplingSection)
    for root in (RLRunConfig, RealtimeConfig):
        assert issubclass(root.model_fields["model"].annotation, ModelSection)
    # each keeps its defaults: rollouts sample at 0.8 with the trainer's model, the gate greedily
    ro, gate = RolloutSection(), GateSection(suite="smoke")
    assert (ro.temperature, ro.max_batch, ro.engine) == (0.8, 16, "hf")
    assert (gate.temperature, gate.max_batch, gate.engine, gate.max_new_tokens) == (0.0, 8, "builtin", 256)
    base = '[logs]\ndir = "l"\n[model]\nname = "tiny-random"\n[gate]\nsuite = "smoke"\n'
    for extra, key, says in (("temperature = -1", "gate.temperature", "greater than or equal to 0"),
                             ('engine = "server"', "gate.engine", "'hf' or 'builtin'")):
        with pytest.raises(ConfigError) as e:
            load_config(write(tmp_path, base + extra + "\n"), RealtimeConfig)
        assert key in str(e.value) and says in str(e.value)


def test_realtime_refuses_what_it_cannot_do(tmp_path):
    from opencomposer.realtime.config import RealtimeConfig

    with pytest.raises(ConfigError, match=r"key 'model.name': required but missing"):
        load_config(write(tmp_path, '[logs]\ndir = "l"\n[model]\ndevice = "cpu"\n[gate]\nsuite = "s"\n'),
                    RealtimeConfig)
    with pytest.raises(ConfigError, match=r"c.toml: .*loss.kl_coef = 0.1: the realtime loop trains without a KL"):
        load_config(write(tmp_path, '[logs]\ndir = "l"\n[model]\nname = "m"\n[gate]\nsuite = "s"\n'
                                    '[loss]\nkl_coef = 0.1\n'), RealtimeConfig)


def test_a_shipped_config_of_another_command_is_refused_naming_whose_it_is(tmp_path):
    from opencomposer.cli.configs import load_for
    from opencomposer.config import AgentRunConfig
    from opencomposer.realtime.config import RealtimeConfig
    from opencomposer.rl.config import RLRunConfig

    root = Path(__file__).resolve().parents[2] / "configs"
    with pytest.raises(ConfigError, match=r"realtime\.toml: a config of `opencomposer realtime` \(RealtimeConfig\), "
                                          r"not of this command \(RLRunConfig: configs/train/\)"):
        load_for(root / "realtime" / "realtime.toml", RLRunConfig)
    assert load_for(root / "train" / "demo.toml", RLRunConfig).run.out_dir == "runs/demo"
    assert isinstance(load_for(root / "realtime" / "realtime.toml", RealtimeConfig), RealtimeConfig)
    mine = tmp_path / "agent.toml"  # a config outside configs/ is only validated
    mine.write_text("[agent]\nmax_turns = 3\n")
    assert load_for(mine, AgentRunConfig).agent.max_turns == 3
