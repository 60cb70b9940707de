"""``ServeHost``: ``opencomposer serve`` in a thread of a process that is not its own (a Ray
engine actor's, ``rl/cluster.py``), following a weight store; and ``ServerPolicy.wait_for_version``
not taking the version a follower loaded for one it applied from the store."""

from __future__ import annotations

import httpx
import pytest
import torch

from opencomposer.inference.server.app import ServeConfig
from opencomposer.inference.server.host import ServeHost
from opencomposer.models.registry import load_model
from opencomposer.policies.server import ServerPolicy, ServerUnavailable
from opencomposer.sync.publisher import WeightPublisher
from opencomposer.sync.store import open_store


def test_a_host_serves_follows_the_store_and_stops(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    host = ServeHost(ServeConfig(model="tiny-random", max_num_seqs=4, max_model_len=256, weights_from=str(store),
                                 weights_poll_s=0.05), bind="127.0.0.1")
    try:
        url = host.url()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        assert httpx.get(url.removesuffix("/v1") + "/health", timeout=10).status_code == 200
        model, tok = load_model("tiny-random")
        policy = ServerPolicy(url, tok, temperature=0.0, max_new_tokens=4)
        # the engine loaded "version 0" itself; the store's version 0 (other weights) is not applied yet
        with pytest.raises(ServerUnavailable, match=r"still runs policy version None .* not 0"):
            policy.wait_for_version(0, timeout_s=0.3)
        state = {k: v + 0.5 if v.is_floating_point() else v for k, v in model.state_dict().items()}
        WeightPublisher(open_store(store), dtype="float32").publish(state, 0)
        policy.wait_for_version(0, timeout_s=30)
        info = host.info()
        assert info["version"] == 0 and info["device"] == "cpu" and info["engine_error"] is None
        name = next(k for k, v in state.items() if v.is_floating_point() and v.dim() == 2)
        served = dict(host.front.arms["a"].loop.engine.model.named_parameters())[name]
        assert torch.equal(served.detach().cpu(), state[name])  # the store's weights, not the loaded ones
        policy.close()
    finally:
        host.stop()
    with pytest.raises(httpx.TransportError):
        httpx.get(url.removesuffix("/v1") + "/health", timeout=2)


def test_a_host_that_cannot_load_its_model_says_so(tmp_path):
    with pytest.raises(Exception, match=r"no-such-model"):
        ServeHost(ServeConfig(model=str(tmp_path / "no-such-model")), bind="127.0.0.1")
