"""Several rollout engines of an RL run (``rl/engines.py``) on tiny-random (CPU): the settings
refused with the keys named, two built-in engines built on the learner's weights and kept on
them (a failed one rebuilt on the weights of the next sync, a failed update naming the engine),
and servers of different models refused at start.

Run: ``pytest tests/unit/rl/test_engines.py``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from opencomposer.config import ConfigError, load_config
from opencomposer.policies.batched import EngineStepError
from opencomposer.policies.fanout import EngineError, EngineFailed, FanoutPolicy
from opencomposer.protocols import Message
from opencomposer.rl.config import RLRunConfig
from opencomposer.rl.engines import ENGINE_SEED_STRIDE, rollout_engines, sync_engines
from opencomposer.rl.learner import Weights

CONV = [Message("system", "You are a coding agent."), Message("user", "Fix the bug in stats.py.")]


def load(tmp_path: Path, rollout: str, extra: str = "") -> RLRunConfig:
    p = tmp_path / "c.toml"
    p.write_text(f"[tasks]\ndir = 'x'\n[rollout]\n{rollout}\n{extra}")
    return load_config(p, RLRunConfig)


@pytest.mark.parametrize("rollout, says", [
    ("engines = 0", r"rollout.engines.*greater than or equal to 1"),
    ("engines = 2", r"rollout.engines = 2 with rollout.engine='hf': 'hf' samples with the trainer's own model"),
    ("engine = 'vllm'\nbase_url = 'http://h:8000/v1'\nengines = 2",
     r"rollout.engines = 2 with rollout.engine='vllm' needs rollout.base_urls \(one server per engine\)"),
    ("engine = 'sglang'\nbase_urls = ['http://a/v1', 'http://b/v1']\nengines = 3",
     r"rollout.engines = 3 but rollout.base_urls lists 2 server\(s\): with rollout.engine='sglang'"),
    ("engine = 'builtin'\nengines = 2\nengine_devices = ['cuda:0']",
     r"rollout.engine_devices lists 1 device\(s\) for rollout.engines = 2: give one device per engine"),
    ("engine = 'builtin'\nengine_devices = ['cuda:0', 'cuda:1']",
     r"rollout.engine_devices lists 2 device\(s\) for rollout.engines = 1"),
    ("engine = 'builtin'\nengines = 2\nengine_devices = ['cuda:0', ' ']", r"rollout.engine_devices\[1\] is empty"),
    ("engine = 'server'\nbase_url = 'http://a/v1'\nengine_devices = ['cuda:0']",
     r"rollout.engine_devices places built-in engines; rollout.engine is 'server'"),
    ("engine = 'builtin'\nengines = 2\nbase_urls = ['http://a/v1', 'http://b/v1']",
     r"rollout.base_urls \(several servers\) needs rollout.engine='server', 'vllm' or 'sglang'; rollout.engine is "
     r"'builtin'"),
    ("engine = 'server'\nbase_url = 'http://a/v1'\nbase_urls = ['http://b/v1']",
     r"rollout.base_url and rollout.base_urls are both set"),
    ("engine = 'server'\nbase_urls = ['http://a/v1', 'http://a/v1']",
     r"rollout.base_urls lists http://a/v1 more than once"),
    ("engine = 'server'\nbase_urls = ['http://a/v1', 'http://b/v1']\nengines = 3",
     r"rollout.engines = 3 but rollout.base_urls lists 2 server\(s\)"),
    ("engine = 'server'\nbase_url = 'http://a/v1'\nengines = 2",
     r"rollout.engines = 2 with rollout.engine='server' needs rollout.base_urls"),
    ("engine = 'server'\nbase_urls = []", r"rollout.base_urls.*at least 1 item"),
])
def test_engine_settings_that_cannot_work_are_refused_naming_the_keys(tmp_path, rollout, says):
    with pytest.raises(ConfigError, match=says):
        load(tmp_path, rollout, "[sync]\nstore = 'w'\n")


def test_engine_settings_that_work(tmp_path):
    r = load(tmp_path, "engine = 'builtin'\nengines = 2\nengine_devices = ['cuda:0', 'cuda:1']").rollout
    assert r.engine_count == 2 and r.engine_devices == ["cuda:0", "cuda:1"]
    r = load(tmp_path, "engine = 'server'\nbase_urls = ['http://a/v1', 'http://b/v1']", "[sync]\nstore = 'w'\n").rollout
    assert r.engine_count == 2 and r.servers == ["http://a/v1", "http://b/v1"]
    r = load(tmp_path, "engine = 'server'\nbase_url = 'http://a/v1'", "[sync]\nstore = 'w'\n").rollout
    assert r.engine_count == 1 and r.servers == ["http://a/v1"]  # one server, as before
    r = load(tmp_path, "engine = 'vllm'\nbase_urls = ['http://a/v1', 'http://b/v1']").rollout
    assert r.engine_count == 2 and r.servers == ["http://a/v1", "http://b/v1"]  # several vLLM servers
    dumped = RLRunConfig.model_validate(load(tmp_path, "engine = 'server'\nbase_urls = ['http://a/v1', 'http://b/v1']",
                                             "[sync]\nstore = 'w'\n").model_dump())
    assert dumped.rollout.engine_count == 2  # a dumped config reads back (engines = 1 written out)


def raises(message: str):
    """A stand-in for one engine method that fails (the engine object itself is real)."""
    def fail(*args, **kwargs):
        raise RuntimeError(message)
    return fail


def _cfg(tmp_path: Path, **rollout) -> RLRunConfig:
    return RLRunConfig.model_validate({
        "model": {"name": "tiny-random"}, "tasks": {"dir": str(tmp_path / "tasks")},
        "rollout": {"engine": "builtin", "engines": 2, "engine_devices": ["cpu", "cpu"], "max_new_tokens": 6,
                    "temperature": 0.0, **rollout},
        "run": {"out_dir": str(tmp_path / "run"), "seed": 7}})


def _moved(tiny, version: int) -> Weights:
    """The learner's weights at ``version``: the model's, nudged (each version differently; tied
    weights stay tied, as a trainer's do)."""
    gen, model = torch.Generator().manual_seed(version), copy.deepcopy(tiny[0])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return Weights(version, model.state_dict())


def test_two_builtin_engines_start_on_the_weights_and_every_sync_reaches_both(tiny, tmp_path):
    cfg = _cfg(tmp_path)
    current = [Weights(0, tiny[0].state_dict(), tiny)]
    policy = rollout_engines(cfg, lambda: current[0], tiny[1], 0.0, "cpu", "tiny-random")
    try:
        assert isinstance(policy, FanoutPolicy) and [s.label for s in policy.slots] == ["engine 0 (cpu)",
                                                                                       "engine 1 (cpu)"]
        inner = [p.policy for p in policy.engines()]
        assert [p.seed for p in inner] == [7, 7 + ENGINE_SEED_STRIDE]  # no two engines draw the same numbers
        assert inner[0].engine is not inner[1].engine and policy.versions() == {0: 0, 1: 0}

        def greedy():
            outs = [p.act(CONV, []) for p in policy.engines()]
            assert outs[0].token_ids == outs[1].token_ids  # the same weights on both
            return outs[0]

        before = greedy()
        current[0] = _moved(tiny, 1)
        assert sync_engines(policy, cfg, current[0], publish=lambda: None) == {}
        assert policy.versions() == {0: 1, 1: 1}
        after = greedy()
        assert set(after.policy_versions) == {1} and after.logprobs != before.logprobs

        # engine 1 fails mid-step: out of dispatch until the next sync, which rebuilds it on the weights of then
        eng1 = inner[1].engine
        eng1.step = raises("CUDA error: device lost")
        void = pytest.raises(EngineFailed, match=r"engine 1 \(cpu\) failed")  # the episode on it is void
        with void, policy.episode(group="a") as s0, policy.episode(group="b") as s1:
            assert (s0.engine, s1.engine) == (0, 1)
            with pytest.warns(RuntimeWarning, match=r"engine 1 \(cpu\) failed"), pytest.raises(EngineStepError):
                s1.act(CONV, [])
        assert policy.up == 1
        current[0] = _moved(tiny, 2)
        sync_engines(policy, cfg, current[0], publish=lambda: None)
        fresh = policy.slots[1].policy.policy
        assert policy.up == 2 and fresh.engine is not eng1 and policy.versions() == {0: 2, 1: 2}
        assert fresh.seed == 7 + (1 + 2 * 1) * ENGINE_SEED_STRIDE  # a stream of its own, not the failed one's
        greedy()

        # an update that fails on one engine stops the sync with that engine named
        fresh.engine.update_weights = raises("size mismatch")
        with pytest.raises(EngineError, match=r"rollout engine 1 \(cpu\): could not take the weights of version 3: "
                                              r"RuntimeError: size mismatch"):
            sync_engines(policy, cfg, _moved(tiny, 3), publish=lambda: None)
    finally:
        policy.close()


def test_one_engine_is_the_batched_policy_it_always_was(tiny, tmp_path):
    cfg = _cfg(tmp_path, engines=1, engine_devices=None)
    policy = rollout_engines(cfg, lambda: Weights(0, tiny[0].state_dict(), tiny), tiny[1], 0.0, "cpu", "tiny-random")
    try:
        assert not isinstance(policy, FanoutPolicy) and policy.policy.seed == 7
        sync_engines(policy, cfg, _moved(tiny, 1), publish=lambda: None)
        assert policy.policy_version == 1
    finally:
        policy.close()


def test_servers_of_different_models_are_refused_naming_both(tiny, tmp_path):
    from testkit.live_server import serve_in_thread

    from opencomposer.inference.server.app import ServeConfig, build_server

    running = [serve_in_thread(build_server(ServeConfig(model="tiny-random", served_model_name=name,
                                                        max_num_seqs=2, max_model_len=64)))
               for name in ("policy-a", "policy-b")]
    try:
        urls = [f"{base}/v1" for _, _, base in running]
        cfg = RLRunConfig.model_validate({
            "model": {"name": "tiny-random"}, "tasks": {"dir": str(tmp_path / "tasks")},
            "rollout": {"engine": "server", "base_urls": urls, "max_new_tokens": 4}, "sync": {"store": str(tmp_path)},
            "run": {"out_dir": str(tmp_path / "run")}})
        with pytest.raises(ConfigError, match=rf"rollout engine 1 \({urls[1]}\) serves 'policy-b' .*rollout engine 0 "
                                              rf"\({urls[0]}\) serves 'policy-a'.*must serve the run's model"):
            rollout_engines(cfg, lambda: Weights(0, {}, None), tiny[1], 0.0, "cpu", "tiny-random")
    finally:
        for uv, thread, _ in running:
            uv.should_exit = True
            thread.join(10)


def test_switch_interval_is_set_when_a_builtin_engine_is_built_and_only_then(tiny, tmp_path):
    default = sys.getswitchinterval()
    current = Weights(0, tiny[0].state_dict(), tiny)
    try:
        policy = rollout_engines(_cfg(tmp_path, engines=1, engine_devices=None), lambda: current, tiny[1], 0.0,
                                 "cpu", "tiny-random")
        policy.close()
        assert sys.getswitchinterval() == default  # unset: Python's own
        policy = rollout_engines(_cfg(tmp_path, engines=1, engine_devices=None, switch_interval_ms=0.5),
                                 lambda: current, tiny[1], 0.0, "cpu", "tiny-random")
        policy.close()
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(default)
    with pytest.raises(ConfigError, match=r"rollout.switch_interval_ms"):
        load(tmp_path, "engine = 'builtin'\nswitch_interval_ms = 0")
