"""RL rollouts on a vLLM or SGLang server (``[rollout] engine = "vllm" | "sglang"``): the client
built and checked, then given the trainer's weights before it samples; after each update the
weights are written to a directory the server reads and loaded through its update endpoint.

    external = ExternalEngine(cfg, model_config)                      # once, in the actor
    policy = external.policy(weights, tokenizer, temperature=1.0)     # refuses another model
    external.push(policy, new_weights)                                # after an update

At start: the server must serve the run's model (``[rollout] served_model``, else ``[model]
name``; ``policies/external.py`` refuses another, naming both). A MoE model trains with router
replay, which needs the experts each sampled token went to: a server that returns none is
refused, unless ``[rollout] allow_missing_routes = true`` (then the run trains without replay
for its tokens, and says so on stderr and as a warning). Every push writes the version to
``[rollout] weights_dir`` (``sync/weights_dir.py``) and waits for the server to acknowledge it;
the tokens sampled after it are tagged with that version.

Test: ``pytest tests/unit/rl/test_external_engine.py tests/integration/test_rl_external_engines.py``.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

from opencomposer.config import ConfigError
from opencomposer.policies import make_policy
from opencomposer.policies.batched import BatchedPolicy
from opencomposer.policies.fanout import FanoutPolicy, each_engine
from opencomposer.rl.config import RLRunConfig
from opencomposer.rl.learner import Weights
from opencomposer.sync.weights_dir import WeightsDir

EXTERNAL = ("vllm", "sglang")


def experts_per_token(model_config: Any) -> int:
    """The experts a token is routed to in a MoE model (router replay is on for it); 0 when dense."""
    moe = getattr(model_config, "num_experts", 0) or getattr(model_config, "num_local_experts", 0)
    return int(getattr(model_config, "num_experts_per_tok", 0) or 0) if moe else 0


class ExternalEngine:
    def __init__(self, cfg: RLRunConfig, model_config: Any):
        self.cfg, self.experts_per_token = cfg, experts_per_token(model_config)
        root = cfg.rollout.weights_dir or Path(cfg.run.out_dir) / "engine_weights"
        self.dir = WeightsDir(root, config=model_config)

    def policy(self, weights: Weights, tokenizer: Any, temperature: float, engine: int = 0,
               seed: int | None = None) -> BatchedPolicy:
        """A batched client of server ``engine`` (``rollout.base_urls``; the first, or
        ``base_url``), checked, and on ``weights`` (pushed now); ``seed``: its sampler's
        (default ``run.seed``)."""
        r = self.cfg.rollout
        policy = make_policy(r.engine, base_url=r.servers[engine], tokenizer=tokenizer,
                             model=r.served_model or self.cfg.model.name, experts_per_token=self.experts_per_token,
                             temperature=temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                             seed=self.cfg.run.seed if seed is None else seed, batch=r.max_batch)
        try:
            if self.experts_per_token and not policy.policy.check_routes():
                self._no_routes(policy.policy.where())
            self.push(policy, weights)
        except BaseException:
            policy.close()
            raise
        return policy

    def push(self, policy: BatchedPolicy | FanoutPolicy, weights: Weights) -> dict[str, float]:
        """``weights`` to the server, or to each of several (written to ``weights_dir`` once,
        then loaded and acknowledged by each; a failure names the engine); the seconds it took,
        for the step's row."""
        t0 = time.perf_counter()
        path = self.dir.write(weights.state, weights.version)
        each_engine(policy, lambda p: p.policy.push_weights(path, weights.version),
                    f"load the weights of version {weights.version} from {path}")
        return {"time_engine_push": round(time.perf_counter() - t0, 3)}

    def _no_routes(self, where: str) -> None:
        msg = (f"{where} returns no MoE routes (the experts each token went to), which router replay needs: "
               "start it with --enable-return-routed-experts")
        if not self.cfg.rollout.allow_missing_routes:
            raise ConfigError(f"{msg}, or set [rollout] allow_missing_routes = true to train without replay")
        msg = f"[rollout] allow_missing_routes = true: {msg}; training WITHOUT router replay on its tokens"
        print(f"WARNING: {msg}", file=sys.stderr, flush=True)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
