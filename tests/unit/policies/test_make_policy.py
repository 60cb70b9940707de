"""``make_policy``: every kind built from its spec and run for real at small size (a HumanEval
task, an HTTP server, the tiny-random model, the engine), and bad specs answered with errors that
name the spec, the field and what it takes.

Run: ``pytest tests/unit/policies/test_make_policy.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from opencomposer.config import ConfigError
from opencomposer.policies import POLICIES, make_policy
from opencomposer.protocols import Message, Policy, PolicyOutput, ToolCall
from testkit.openai_stub import FakeServer, completion

ASK = [Message("system", "You are a coding agent."), Message("user", "List the files, then read setup.py")]


@pytest.fixture(scope="module")
def tiny():
    from opencomposer.models.registry import load_model

    return load_model("tiny-random")


def test_oracle_solves_a_real_task(tmp_path):
    from opencomposer.episode.run import run_task
    from opencomposer.tasks.format import Task
    from opencomposer.tasks.sources.humaneval import import_humaneval

    rep = import_humaneval(tmp_path, [0], env=Path(sys.prefix))
    task = Task.load(tmp_path / rep.ok[0])
    policy = make_policy("oracle", task=task, compact=True)
    assert isinstance(policy, Policy) and policy.name == f"oracle:{task.id}" and policy.compact
    res = run_task(task, policy, "local")
    assert res.reward.passed and res.trajectory.exit_reason == "submitted"
    assert res.trajectory.turns <= 4  # compact: list_dir + search share a turn, run + submit another


def test_scripted_plays_its_turns_then_stops():
    from opencomposer.policies.scripted import ScriptOver

    policy = make_policy("scripted", turns=[[ToolCall("list_dir", {})], "done, no call"])
    assert policy.act(ASK, []).tool_calls[0].name == "list_dir"
    assert policy.act(ASK, []).text == "done, no call"
    with pytest.raises(ScriptOver, match="has 2 turns; asked for turn 3"):
        policy.act(ASK, [])


def test_openai_spec_names_the_model_and_options_reach_the_request():
    pytest.importorskip("openai")
    server = FakeServer()
    server.replies.append((200, completion("hello", finish="stop", usage=(9, 1))))
    try:
        policy = make_policy("openai:served-model", base_url=server.url, api_key="sk-test", temperature=0.3,
                             max_tokens=5, max_retries=0, extra_body={"user": "s1"})
        out = policy.act(ASK, [])
    finally:
        server.close()
    assert policy.name == "openai:served-model"
    assert out.text == "hello" and out.prompt_tokens == 9 and out.completion_tokens == 1
    [body] = [r["body"] for r in server.requests]
    assert body["model"] == "served-model" and body["temperature"] == 0.3 and body["max_tokens"] == 5
    assert body["user"] == "s1" and body["messages"][1]["content"] == ASK[1].content


def test_model_by_name_and_by_pair_batched_samples_the_same(tiny):
    from opencomposer.policies.batched import BatchedPolicy
    from opencomposer.policies.model import ModelPolicy

    alone = make_policy("model:tiny-random", temperature=0, max_new_tokens=6)
    assert isinstance(alone, ModelPolicy) and alone.name == "tiny-random"
    with make_policy("model", model=tiny, temperature=0, max_new_tokens=6, policy_version=4, batch=2,
                     name="ckpt-4") as batched:
        assert isinstance(batched, BatchedPolicy) and batched.max_batch == 2 and batched.name == "ckpt-4"
        assert batched.policy.name == "tiny-random"  # ``name`` names what the caller holds
        out = batched.act(ASK, [])
    ref = alone.act(ASK, [])
    assert out.token_ids == ref.token_ids and out.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert out.policy_version == 4 and ref.policy_version == 0


def test_engine_fills_the_declared_per_token_fields(tiny):
    from opencomposer.inference.engine.core import Engine
    from opencomposer.models.chat import encode_prompt, render_prompt

    hf, tok = tiny
    engine = Engine(hf, tok, max_num_seqs=2, max_model_len=512, policy_version=2)
    with make_policy("engine", engine=engine, temperature=0, max_new_tokens=6, seed=0, batch=2) as policy:
        out = policy.act(ASK, [])
    assert isinstance(out, PolicyOutput) and len(out.token_ids) == len(out.logprobs) > 0
    assert out.policy_version == 2 and out.policy_versions == [2] * len(out.token_ids)
    assert out.prompt_ids == encode_prompt(tok, render_prompt(tok, ASK, []))
    assert PolicyOutput("", []).policy_versions == [] and PolicyOutput("", []).prompt_ids == []  # declared


def test_server_spec_reaches_the_url():
    from opencomposer.policies.server import ServerUnavailable

    with pytest.raises(ServerUnavailable, match=r"unreachable at http://127\.0\.0\.1:9/v1/models"):
        make_policy("server", base_url="http://127.0.0.1:9/v1", tokenizer=object(), timeout=2, batch=4)


@pytest.mark.parametrize("spec, options, said", [
    ("gpt", {}, "policy spec 'gpt': unknown kind; expected one of oracle, scripted, openai, model, engine, server"),
    ("oracle", {}, "policy spec 'oracle': missing option 'task': the task (a tasks.format.Task)"),
    ("openai", {"base_url": "http://x/v1"}, "policy spec 'openai': missing option 'model': the model id"),
    ("server", {"base_url": "http://x/v1"}, "policy spec 'server': missing option 'tokenizer': the tokenizer"),
    ("engine", {}, "policy spec 'engine': missing option 'engine': an inference.engine.core.Engine"),
    ("scripted", {"turns": [], "temprature": 1},
     "policy spec 'scripted': unknown option(s) ['temprature']; ScriptedPolicy takes turns"),
    ("openai:m", {"model": "n"}, "policy spec 'openai:m': the model is given twice"),
    ("oracle", {"task": None, "batch": 4},
     "policy spec 'oracle': batch=4 needs a local sampler (model, engine, server, vllm, sglang)"),
    ("model", {"batch": 0}, "policy spec 'model': batch: expected an integer >= 1"),
])
def test_bad_specs_say_what_is_wrong(spec, options, said):
    with pytest.raises(ConfigError) as e:
        make_policy(spec, **options)
    assert str(e.value).startswith(said), str(e.value)


def test_unknown_option_lists_what_the_class_takes():
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['temprature'\]; ModelPolicy takes model, "
                                          r"temperature, .*policy_version, and batch"):
        make_policy("model", temprature=0.5)


def test_only_the_chosen_kind_is_imported():
    """A lazy registry: building a scripted policy loads neither torch nor the openai client."""
    code = ("import sys; from opencomposer.policies import make_policy; make_policy('scripted', turns=[]); "
            "print(sorted(m for m in ('torch', 'openai', 'opencomposer.policies.model') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert r.stdout.strip() == "[]"
    assert set(POLICIES) == {"oracle", "scripted", "openai", "model", "engine", "server", "vllm",
                             "sglang"}
