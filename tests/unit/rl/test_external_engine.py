"""``[rollout] engine = "vllm" | "sglang"``: the config's checks, and MoE routes at start (a
server without them is refused unless allowed, loudly; one with them feeds router replay),
against the stand-ins of tests/testkit on tiny-random-moe."""

from __future__ import annotations

import pytest

from opencomposer.config import ConfigError
from opencomposer.inference.engine.core import SamplingParams
from opencomposer.models.moe_replay import decode_routes
from opencomposer.models.registry import load_model
from opencomposer.rl.config import RLRunConfig
from opencomposer.rl.external_engine import ExternalEngine, experts_per_token
from opencomposer.rl.learner import Weights

from testkit.engine_standin import Backend, serving
from testkit.sglang_standin import SGLangStandin
from testkit.vllm_standin import VLLMStandin

KINDS = {"vllm": VLLMStandin, "sglang": SGLangStandin}


def _cfg(tmp_path, **rollout) -> RLRunConfig:
    return RLRunConfig.model_validate({
        "model": {"name": "tiny-random-moe"}, "tasks": {"dir": str(tmp_path / "tasks")},
        "rollout": {"engine": "vllm", "base_url": "http://127.0.0.1:9/v1", "max_new_tokens": 6, "temperature": 0.0,
                    "weights_dir": str(tmp_path / "w"), **rollout},
        "run": {"out_dir": str(tmp_path / "run")}})


@pytest.mark.parametrize("bad, says", [
    ({"base_url": None}, r"rollout.engine='vllm' needs rollout.base_url"),
    ({"max_staleness": 1}, r"rollout.engine='vllm' with rollout.max_staleness >= 1: .*between steps only"),
    ({"engine": "tgi"}, r"rollout.engine"),
])
def test_the_config_refuses_what_an_external_engine_cannot_do(tmp_path, bad, says):
    with pytest.raises(ValueError, match=says):
        _cfg(tmp_path, **bad)


def test_lora_is_refused_with_an_external_engine(tmp_path):
    with pytest.raises(ValueError, match=r"rollout.engine='sglang' with train.lora=true"):
        RLRunConfig.model_validate({"tasks": {"dir": "t"}, "train": {"lora": True},
                                    "rollout": {"engine": "sglang", "base_url": "http://h:1"}})


@pytest.fixture(scope="module")
def moe():
    return Backend("tiny-random-moe"), load_model("tiny-random-moe")


@pytest.mark.parametrize("kind", KINDS)
def test_moe_without_routes_is_refused_at_start_unless_allowed(kind, moe, tmp_path):
    backend, (model, tok) = moe
    weights = Weights(0, model.state_dict(), (model, tok))
    assert experts_per_token(model.config) == 2
    with serving(KINDS[kind](backend).app) as url:
        cfg = _cfg(tmp_path, engine=kind, base_url=url)
        says = rf"{kind} engine at {url} returns no MoE routes .*--enable-return-routed-experts, or set \[rollout\] "
        with pytest.raises(ConfigError, match=says + "allow_missing_routes"):
            ExternalEngine(cfg, model.config).policy(weights, tok, 0.0)
        cfg = _cfg(tmp_path, engine=kind, base_url=url, allow_missing_routes=True)
        with pytest.warns(RuntimeWarning, match=r"training WITHOUT router replay"):
            policy = ExternalEngine(cfg, model.config).policy(weights, tok, 0.0)
        assert policy.policy_version == 0
        policy.close()


@pytest.mark.parametrize("kind", KINDS)
def test_moe_routes_from_the_server_reach_the_policy_output(kind, moe, tmp_path):
    backend, (model, tok) = moe
    with serving(KINDS[kind](backend, return_routed_experts=True).app) as url:
        policy = ExternalEngine(_cfg(tmp_path, engine=kind, base_url=url), model.config).policy(
            Weights(0, model.state_dict(), (model, tok)), tok, 0.0)
        prompt = tok.encode("def add(a, b):", add_special_tokens=False)
        out = policy.policy.sample_batch([prompt])[0]
        routes = decode_routes(out.routes)
        assert routes.shape == (len(prompt) + len(out.token_ids) - 1, 2, 2)
        want = backend.engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0,
                                                                stop_token_ids=tuple(policy.policy.stop_ids)))[0]
        assert want.token_ids == out.token_ids and routes.tolist() == want.routes.tolist()
        policy.close()
