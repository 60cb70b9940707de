"""``ServerPolicy`` against a real ``opencomposer serve`` (tiny-random, in a thread): the exact
sampled ids, logprobs and versions come back; an unreachable URL and a lagging server are
errors naming the URL."""

from __future__ import annotations

import threading
import time

import pytest

from opencomposer.inference.engine.core import Engine, SamplingParams
from opencomposer.policies.server import ServerPolicy, ServerUnavailable
from opencomposer.inference.server.app import ServeConfig, build_server, uvicorn_server
from opencomposer.models.registry import load_model
from opencomposer.protocols import Message


@pytest.fixture(scope="module")
def url():
    server = build_server(ServeConfig(model="tiny-random", max_num_seqs=4, max_model_len=512))
    uv = uvicorn_server(server, "127.0.0.1", 0)
    t = threading.Thread(target=uv.run, daemon=True)
    t.start()
    while not uv.started:
        assert t.is_alive()
        time.sleep(0.02)
    yield f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}/v1"
    uv.should_exit = True
    t.join(10)
    server.loop.stop()


def test_samples_are_the_servers_exact_tokens(url):
    hf, tok = load_model("tiny-random")
    policy = ServerPolicy(url, tok, temperature=0.0, max_new_tokens=8)
    ids = policy.encode([Message("user", "Fix the bug in utils.py")], tools=[])
    outs = policy.sample_batch([ids, ids[:-3]])
    want = Engine(hf, tok, max_model_len=512).generate([ids, ids[:-3]], SamplingParams(max_tokens=8, temperature=0))
    for out, w in zip(outs, want):
        assert out.token_ids == w.token_ids and out.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert out.policy_version == 0 and out.policy_versions == [0] * len(w.token_ids)
        assert out.text == w.text and out.completion_tokens == len(w.token_ids)
    assert policy.max_model_len == 512
    with pytest.raises(ServerUnavailable, match=r"still runs policy version 0 after 0 s, not 3: .*--weights-from"):
        policy.wait_for_version(3, timeout_s=0.2)
    policy.close()


def test_an_unreachable_server_is_named():
    _, tok = load_model("tiny-random")
    with pytest.raises(ServerUnavailable, match=r"server unreachable at http://127.0.0.1:9/v1/models"):
        ServerPolicy("http://127.0.0.1:9/v1", tok, timeout=5)
