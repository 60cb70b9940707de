"""``[cluster]`` (``rl/cluster.py``): what a config may ask of Ray, the capacity check made
before any actor starts, and the paths actors on other nodes are given."""

from __future__ import annotations

import pytest

from opencomposer.config import ConfigError, load_config
from opencomposer.rl.cluster import ClusterError, absolute, check_capacity
from opencomposer.rl.config import ClusterSection, RLRunConfig

BASE = """
[tasks]
dir = "tasks"
[rollout]
engine = "{engine}"
{rollout}
[run]
out_dir = "runs/x"
"""


def _load(tmp_path, cluster: str, engine: str = "server", sync: bool = True, extra: str = "",
          rollout: str = "") -> RLRunConfig:
    text = BASE.format(engine=engine, rollout=rollout) + extra + ('[sync]\nstore = "store"\n' if sync else "") + "[cluster]\n" + cluster
    p = tmp_path / "c.toml"
    p.write_text(text)
    return load_config(p, RLRunConfig)


def test_engine_actors_are_servers_that_follow_a_store(tmp_path):
    cfg = _load(tmp_path, 'ray = "auto"\nengines = 2\nsandbox_hosts = 4\n')
    assert cfg.cluster.engines == 2 and cfg.rollout.servers == []
    with pytest.raises(ConfigError, match=r"cluster.engines = 2 starts `opencomposer serve` actors .* rollout.engine "
                                          r"= 'server' .*got rollout.engine = 'builtin'"):
        _load(tmp_path, 'ray = "auto"\nengines = 2\n', engine="builtin")
    with pytest.raises(ConfigError, match=r"base_url\(s\) \['http://a:1/v1'\]"):
        _load(tmp_path, 'ray = "auto"\nengines = 2\n', rollout='base_url = "http://a:1/v1"')
    with pytest.raises(ConfigError, match=r"cluster.engines = 1 needs a \[sync\] store every node can read"):
        _load(tmp_path, 'ray = "auto"\nengines = 1\n', sync=False)


def test_what_cannot_be_placed_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"\[cluster\] places nothing"):
        _load(tmp_path, 'ray = "auto"\n')
    with pytest.raises(ConfigError, match=r"cluster.local_cpus / local_gpus describe a Ray started here"):
        _load(tmp_path, 'ray = "auto"\nsandbox_hosts = 1\nlocal_gpus = [1]\n', engine="builtin", sync=False)
    with pytest.raises(ConfigError, match=r"cluster.sandbox_hosts with \[rollout.sandbox_pool\]"):
        _load(tmp_path, 'ray = "local"\nsandbox_hosts = 1\n', engine="builtin", sync=False,
              extra="[rollout.sandbox_pool]\nsize = 4\n")
    with pytest.raises(ConfigError, match=r"cluster.engines"):
        _load(tmp_path, 'ray = "auto"\nengines = -1\n')


def test_capacity_is_checked_in_total_naming_the_settings():
    c = ClusterSection(ray="auto", engines=4, engine_gpus=1, engine_cpus=2, sandbox_hosts=8, sandbox_cpus=1,
                       engine_resources={"rollout": 1})
    check_capacity(c, {"CPU": 16, "GPU": 4, "rollout": 4})  # fits exactly
    with pytest.raises(ClusterError) as e:
        check_capacity(c, {"CPU": 15, "GPU": 2})
    msg = str(e.value)
    assert "CPU: 16 asked (cluster.engines x engine_cpus (4 x 2) + cluster.sandbox_hosts x sandbox_cpus (8 x 1)), " \
           "the cluster has 15" in msg
    assert "GPU: 4 asked (cluster.engines x engine_gpus (4 x 1)), the cluster has 2" in msg
    assert "rollout: 4 asked (cluster.engine_resources.rollout x engines), the cluster has 0" in msg


def test_paths_given_to_actors_are_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "store").mkdir()
    assert absolute("store") == absolute("store", path=True) == str(tmp_path / "store")
    assert absolute("runs/not-yet/store", path=True) == str(tmp_path / "runs/not-yet/store")
    assert absolute("file://store") == str(tmp_path / "store")
    assert absolute("s3://bucket/run", path=True) == "s3://bucket/run"
    # model names that are no path here stay names: the registry's, a hub id
    assert absolute("smollm2-135m") == "smollm2-135m"
    assert absolute("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
