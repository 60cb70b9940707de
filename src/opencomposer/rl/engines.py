"""The rollout engines of an RL run: built on the learner's weights, kept on them, and (several
of them, ``[rollout] engines`` or ``base_urls``) behind one ``FanoutPolicy``.

    policy = rollout_engines(cfg, lambda: actor.weights, tokenizer, 1.0, "cuda:0", start_model, publish)
    sync_engines(policy, cfg, new_weights, publish)       # every engine on new_weights.version
    one = rollout_policy(cfg, weights, tokenizer, 0.0, "cpu", start_model)   # one engine (the evaluations)

One engine (the default) is the ``BatchedPolicy`` of ``rollout_policy``, as it always was.
Several, e.g. ``[rollout] engine = "builtin"``, ``engines = 2``, ``engine_devices = ["cuda:0",
"cuda:1"]`` (absent: all on the run's device), or ``engine = "server"``, ``"vllm"`` or
``"sglang"`` with ``base_urls = [...]``: engine i is ``rollout_policy(..., engine=i)``: its own
copy of the weights on its own device (or its own server), its sampler seeded ``run.seed + i *
ENGINE_SEED_STRIDE`` so no two engines draw the same random numbers; they go behind a
``FanoutPolicy`` (``policies/fanout.py``: a group's rollouts on one engine, the least-loaded; a
failed engine out of dispatch). Servers must all serve the run's model (``opencomposer serve``
ones: the same model, checked at start naming both; vLLM/SGLang ones: each checked against the
run's, ``rl/external_engine.py``); a weight update or a wait for a version that fails names the
engine (``EngineError``). vLLM/SGLang servers load each version from the one directory it is
written to (``rollout.weights_dir``), which every one of them must read.

``sync_engines`` (``Actor.sync_weights``): first a fresh built-in engine, on the weights of now,
in place of each that failed (``FanoutPolicy.revive``; servers are not rebuilt), then every
engine up that runs another version takes ``weights`` (built-in: ``update_weights``, in flight;
servers: the weight store, then each waited for). Every token stays tagged with the version of
the engine that sampled it, so staleness is counted as with one engine.

The held-out evaluations sample with one engine (``rollout_policy``: engine 0's device, the
first server), as before.

Test: ``pytest tests/unit/rl/test_engines.py tests/integration/test_rl_engines.py``.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from opencomposer.config import ConfigError
from opencomposer.episode.run import set_episode_nice
from opencomposer.models.registry import load_model
from opencomposer.policies import make_policy
from opencomposer.policies.batched import BatchedPolicy
from opencomposer.policies.fanout import EngineError, FanoutPolicy, each_engine
from opencomposer.rl.config import RLRunConfig
from opencomposer.rl.external_engine import EXTERNAL, ExternalEngine
from opencomposer.rl.learner import Weights

# engine i's sampler draws from seed + i * stride (+ 100_003 per call, + the row: policies/engine.py)
ENGINE_SEED_STRIDE = 2**32


def rollout_policy(cfg: RLRunConfig, weights: Weights, tokenizer: Any, temperature: float, device: str,
                   start_model: str, base_model: bool = False, publish: Callable[[], Any] = lambda: None,
                   external: ExternalEngine | None = None, engine: int = 0,
                   seed_stream: int | None = None, server: str | None = None) -> BatchedPolicy:
    """A batched sampler on ``weights``, or (``base_model``) on a fresh load of the untrained
    model, so the base can be measured at any point of the run.

    ``rollout.engine = "builtin"`` samples with the inference engine, which holds its own
    copy of the weights (``sync_engines`` sends new ones after each update); "hf" samples
    with transformers ``generate`` on the trainer's model itself (one process); "server" with
    an ``opencomposer serve`` that follows the weight store (``publish`` feeds it first); "vllm"
    and "sglang" with such a server, given ``weights`` through ``external`` (``rl/external_engine.py``).
    ``engine``: which of several (its device, its server); ``seed_stream``: which seeds its
    sampler draws (default: ``engine``'s); ``server``: engine ``engine``'s server when it was
    replaced (default: ``rollout.servers[engine]``).
    """
    r, m = cfg.rollout, cfg.model
    stream = engine if seed_stream is None else seed_stream
    sampling = {"temperature": temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens,
                "seed": cfg.run.seed + stream * ENGINE_SEED_STRIDE, "batch": r.max_batch}
    device = r.engine_devices[engine] if r.engine_devices else device
    if r.engine == "server" and not base_model:  # the base model is measured locally (the server trains on)
        policy = make_policy("server", base_url=server or r.servers[engine], tokenizer=tokenizer, **sampling)
        try:
            publish()  # the server samples the trainer's weights, not its own
            policy.policy.wait_for_version(weights.version, r.sync_timeout_s)
        except BaseException:
            policy.close()
            raise
        return policy
    if r.engine in EXTERNAL and not base_model:  # the base model is measured locally here too
        external = external or ExternalEngine(cfg, model_config(weights, start_model))
        return external.policy(weights, tokenizer, temperature, engine=engine, seed=sampling["seed"])
    if base_model or weights.model is None or (r.engine == "builtin" and cfg.train.lora):
        model, tok = load_model(m.name if base_model else start_model, device=device)
        if not base_model:  # the engine's own copy, of the weights gathered from the shards (or LoRA's, merged)
            model.load_state_dict(weights.state)
    else:
        model, tok = weights.model
    version = 0 if base_model else weights.version
    if r.engine == "builtin":
        from opencomposer.inference.engine.core import Engine

        eng = Engine.for_agents(model, tok, max_num_seqs=r.max_batch, device=device, policy_version=version)
        if r.switch_interval_ms:  # process-wide: the engine's thread gets the interpreter back sooner
            sys.setswitchinterval(r.switch_interval_ms / 1000)
        if r.episode_nice:  # process-wide too: episode threads (and what they start) yield the CPU to it
            set_episode_nice(r.episode_nice)
        return make_policy("engine", engine=eng, **sampling)
    return make_policy("model", model=(model, tok), policy_version=version, **sampling)


def model_config(weights: Weights, start_model: str) -> Any:
    """The HF config of the model trained: the trainer's own, or (sharded) a fresh load's."""
    return (weights.model or load_model(start_model))[0].config


def engine_label(cfg: RLRunConfig, device: str, i: int) -> str:
    """How errors and warnings name engine ``i``: "engine 1 (cuda:1)", "engine 0 (http://...)"."""
    r = cfg.rollout
    where = r.servers[i] if r.engine in ("server", *EXTERNAL) else r.engine_devices[i] if r.engine_devices else device
    return f"engine {i} ({where})"


def rollout_engines(cfg: RLRunConfig, weights: Callable[[], Weights], tokenizer: Any, temperature: float,
                    device: str, start_model: str, publish: Callable[[], Any] = lambda: None,
                    external: ExternalEngine | None = None,
                    replace_server: Callable[[int], str] | None = None) -> BatchedPolicy | FanoutPolicy:
    """The rollouts' sampler: ``rollout_policy`` when one engine samples, else a ``FanoutPolicy``
    over ``[rollout] engine_count`` of them; ``weights()`` is read at each build (a failed
    built-in engine is rebuilt on the weights of then). ``replace_server(i)``: a new server in
    place of server engine ``i`` that failed, its URL returned (the Ray cluster's engine actors,
    ``rl/cluster.py``); without it a failed server stays out."""
    n = cfg.rollout.engine_count
    if n == 1:
        return rollout_policy(cfg, weights(), tokenizer, temperature, device, start_model, publish=publish,
                              external=external)
    labels = [engine_label(cfg, device, i) for i in range(n)]
    rebuilds: Counter[int] = Counter()

    def build(i: int, stream: int | None = None, server: str | None = None) -> BatchedPolicy:
        try:
            return rollout_policy(cfg, weights(), tokenizer, temperature, device, start_model, publish=publish,
                                  external=external, engine=i, seed_stream=stream, server=server)
        except Exception as e:
            raise EngineError(f"rollout {labels[i]}: could not start: {type(e).__name__}: {e}") from e

    def rebuild(i: int) -> BatchedPolicy:  # a seed stream of its own: no draw of the failed engine repeats
        rebuilds[i] += 1
        server = replace_server(i) if cfg.rollout.engine == "server" and replace_server is not None else None
        return build(i, stream=i + n * rebuilds[i], server=server)

    built: list[BatchedPolicy] = []
    try:
        for i in range(n):
            built.append(build(i))
        if cfg.rollout.engine == "server":
            same_model(built, labels)
    except BaseException:
        for p in built:
            p.close()
        raise
    rebuildable = cfg.rollout.engine == "builtin" or (cfg.rollout.engine == "server" and replace_server is not None)
    return FanoutPolicy(built, labels, rebuild=rebuild if rebuildable else None)


def same_model(servers: list[BatchedPolicy], labels: list[str]) -> None:
    """Every server serves what the first does (model id, context length); ConfigError names both."""
    first = servers[0].policy
    for label, p in zip(labels[1:], servers[1:]):
        s = p.policy
        if (s.model, s.max_model_len) != (first.model, first.max_model_len):
            raise ConfigError(f"rollout.base_urls: rollout {label} serves {s.model!r} (max_model_len "
                              f"{s.max_model_len}), rollout {labels[0]} serves {first.model!r} (max_model_len "
                              f"{first.max_model_len}): every rollout engine must serve the run's model")


def sync_engines(policy: BatchedPolicy | FanoutPolicy, cfg: RLRunConfig, weights: Weights,
                 publish: Callable[[], Any], wait: bool = True,
                 external: ExternalEngine | None = None) -> dict[str, float]:
    """Make the rollout engines sample from ``weights`` (and say so); see the module docstring.

    The built-in engine takes them between two decode steps, in flight if rollouts are
    running (``max_staleness``); a server gets them through the store (``publish``), and
    ``wait=False`` leaves it to apply them when its follower polls (its tokens then say which
    version ran); a vLLM or SGLang server loads them from a directory and acknowledges the
    version (what that cost is returned, for the step's row; {} otherwise).
    """
    r, w = cfg.rollout, weights
    if isinstance(policy, FanoutPolicy):
        policy.revive()  # fresh built-in engines, on w, for any that failed
    if policy.policy_version == w.version:
        return {}
    if r.engine == "server":  # through the weight store: publish, then wait for each server
        publish()
        if wait:
            doing = f"run version {w.version} within rollout.sync_timeout_s = {r.sync_timeout_s:g} s"
            if isinstance(policy, FanoutPolicy):  # servers that can be replaced (Ray's) are, when they fail here
                policy.each(lambda p: p.policy.wait_for_version(w.version, r.sync_timeout_s), doing,
                            replace_failed=True)
            else:
                each_engine(policy, lambda p: p.policy.wait_for_version(w.version, r.sync_timeout_s), doing)
    elif external is not None:  # written to a directory, loaded through the server's endpoint
        return external.push(policy, w)
    elif r.engine == "builtin":
        def update(p: BatchedPolicy) -> None:
            if p.policy_version != w.version:
                p.policy.update_weights(w.state, w.version)

        each_engine(policy, update, f"take the weights of version {w.version}")
    else:  # same model object: only the label moves
        policy.policy_version = w.version
    return {}
