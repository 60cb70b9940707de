"""The vLLM and SGLang rollout clients against stand-ins that follow those servers' documented
shapes (tests/testkit/vllm_standin.py, sglang_standin.py) on tiny-random: exact token ids and
logprobs, weights pushed from a directory and the version acknowledged, and the errors for a
server without token ids, a failed update, and another model. (No real vLLM or SGLang here.)"""

from __future__ import annotations

import pytest
import torch

from opencomposer.inference.engine.core import Engine, SamplingParams
from opencomposer.models.registry import load_model
from opencomposer.policies import make_policy
from opencomposer.policies.external import EngineError
from opencomposer.protocols import Message
from opencomposer.sync.weights_dir import WeightsDir

from testkit.engine_standin import Backend, Faults, serving
from testkit.sglang_standin import SGLangStandin
from testkit.vllm_standin import VLLMStandin

KINDS = {"vllm": VLLMStandin, "sglang": SGLangStandin}


@pytest.fixture(scope="module")
def backend() -> Backend:
    return Backend("tiny-random")


@pytest.fixture(scope="module")
def tok(backend):
    return backend.tokenizer


def _prompt(tok) -> list[int]:
    from opencomposer.models.chat import encode_prompt, render_prompt

    return encode_prompt(tok, render_prompt(tok, [Message("user", "Fix the bug in utils.py")], []))


def _state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model, _ = load_model("tiny-random")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.state_dict()


@pytest.mark.parametrize("kind", KINDS)
def test_exact_ids_and_logprobs_and_the_pushed_version(kind, backend, tok, tmp_path):
    standin = KINDS[kind](backend)
    with serving(standin.app) as url:
        policy = make_policy(kind, base_url=url + ("/v1" if kind == "vllm" else ""), tokenizer=tok,
                             model="tiny-random", temperature=0.0, max_new_tokens=8)
        prompt = _prompt(tok)
        with pytest.raises(EngineError, match=rf"{kind} engine at {url}: its weights version is unknown"):
            policy.sample_batch([prompt])
        state = _state(1)
        out_dir = WeightsDir(tmp_path / "w", config=load_model("tiny-random")[0].config)
        policy.push_weights(out_dir.write(state, 3), 3)
        assert policy.policy_version == 3 and backend.loaded[-1] == str((tmp_path / "w" / "v3").resolve())
        for name, view in backend.engine.weight_views({k: v.shape for k, v in state.items()}).items():
            assert torch.equal(view, state[name]), name  # the tied lm_head too, written once
        outs = policy.sample_batch([prompt, prompt[:-3]])
        hf, _ = load_model("tiny-random")
        hf.load_state_dict(state)
        want = Engine(hf, tok, max_model_len=2048).generate([prompt, prompt[:-3]], SamplingParams(
            max_tokens=8, temperature=0, stop_token_ids=tuple(policy.stop_ids)))
        for out, w in zip(outs, want):
            assert out.token_ids == w.token_ids and out.logprobs == pytest.approx(w.logprobs, abs=1e-4)
            assert out.policy_version == 3 and out.policy_versions == [3] * len(w.token_ids)
            assert out.text == w.text and out.prompt_tokens == len(out.prompt_ids)
        sent = standin.requests[-1]
        assert (sent.get("prompt") or sent.get("input_ids")) in (prompt, prompt[:-3])  # ids, never text
        assert "text" not in sent
        policy.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_server_without_token_ids_is_refused_naming_the_field(kind, backend, tok, tmp_path):
    with serving(KINDS[kind](backend, Faults(no_token_ids=True)).app) as url:
        policy = make_policy(kind, base_url=url, tokenizer=tok, model="tiny-random", max_new_tokens=4)
        policy.push_weights(WeightsDir(tmp_path).write(_state(2), 1), 1)
        field = "choices\\[0\\].token_ids" if kind == "vllm" else "meta_info.output_token_logprobs"
        with pytest.raises(EngineError, match=rf"{kind} engine at {url}/\w+(/\w+)? answered without token ids: "
                                              rf"{field}"):
            policy.sample_batch([_prompt(tok)])
        policy.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_weight_update_names_the_engine_and_the_http_status(kind, backend, tok, tmp_path):
    with serving(KINDS[kind](backend, Faults(update_status=500)).app) as url:
        policy = make_policy(kind, base_url=url, tokenizer=tok, model="tiny-random")
        path = WeightsDir(tmp_path).write(_state(3), 5)
        with pytest.raises(EngineError, match=rf"weight update to version 5 from {path} failed: {kind} engine at "
                                              rf"{url}/\w+: HTTP 500: .*CUDA out of memory"):
            policy.push_weights(path, 5)
        assert policy.version is None  # nothing is tagged with a version the server did not take
        policy.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_server_on_another_model_is_refused_naming_both(kind, backend, tok):
    with serving(KINDS[kind](backend, Faults(served_as="Qwen/Qwen3-8B")).app) as url:
        with pytest.raises(EngineError, match=rf"{kind} engine at {url}/[\w/]+ serves .*'Qwen/Qwen3-8B'.*not the "
                                              r"run's model 'tiny-random'"):
            make_policy(kind, base_url=url, tokenizer=tok, model="tiny-random")


def test_an_sglang_answer_from_an_unknown_version_is_refused(backend, tok, tmp_path):
    standin = SGLangStandin(backend)
    with serving(standin.app) as url:
        policy = make_policy("sglang", base_url=url, tokenizer=tok, model="tiny-random", max_new_tokens=4)
        policy.push_weights(WeightsDir(tmp_path).write(_state(4), 2), 2)
        assert standin.flushes == 1
        standin.faults.weight_version = "default"
        with pytest.raises(EngineError, match=r"sampled with weights version 'default', not the acknowledged 2"):
            policy.sample_batch([_prompt(tok)])
        policy.close()


def test_vllm_without_dev_mode_says_how_to_enable_weight_updates(backend, tok, tmp_path):
    with serving(VLLMStandin(backend, dev_mode=False).app) as url:
        policy = make_policy("vllm", base_url=url, tokenizer=tok, model="tiny-random")
        with pytest.raises(EngineError, match=r"/collective_rpc: HTTP 404.*VLLM_SERVER_DEV_MODE=1"):
            policy.push_weights(WeightsDir(tmp_path).write(_state(5), 1), 1)
        policy.close()


def test_weights_dir_writes_each_version_whole_and_keeps_the_newest(tmp_path):
    from safetensors.torch import load_file

    model, _ = load_model("tiny-random")
    out = WeightsDir(tmp_path, config=model.config, keep=2)
    for v in (1, 2, 3):
        out.write(model.state_dict(), v)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2", "v3"]
    got = load_file(str(tmp_path / "v3" / "model.safetensors"))
    assert "lm_head.weight" not in got and torch.equal(got["model.embed_tokens.weight"],
                                                       model.state_dict()["model.embed_tokens.weight"])
    assert (tmp_path / "v3" / "config.json").exists()
    again = WeightsDir(tmp_path)  # a restarted run numbers from 0 again: the old v2, v3 go, not its v0
    again.write(model.state_dict(), 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v0"]
