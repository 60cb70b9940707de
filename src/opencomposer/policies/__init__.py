"""Every policy, built in one place: ``make_policy(spec, **options)``.

    from opencomposer.policies import make_policy
    make_policy("oracle", task=task)                                   # solves it from the gold patch
    make_policy("openai:gpt-4.1-mini", base_url=url, temperature=0.2)  # any chat-completions endpoint
    make_policy("model", model="smollm2-135m", max_new_tokens=256, batch=8)   # local HF, batched
    make_policy("engine", engine=engine, temperature=1.0, seed=0)      # the built-in engine
    make_policy("server", base_url=url, tokenizer=tok, batch=8)        # an `opencomposer serve`
    make_policy("vllm", base_url=url, tokenizer=tok, model=name)       # vLLM / SGLang ("sglang"), token ids

``spec`` is a kind of ``POLICIES``, optionally ``kind:MODEL`` (the ``model`` option). The options
are the keyword arguments of that kind's class, checked here by name, so a typo or a missing one
is a ``ConfigError`` naming the spec, the field and what it takes. The class is imported only when
its kind is chosen (the registry holds import paths, as mini-swe-agent's), so an oracle run never
loads torch. ``batch=N`` wraps a local sampler (model, engine, server, vllm, sglang) in
``BatchedPolicy`` with ``max_batch=N``, one batch of episodes per ``generate`` (an engine: served
continuously, each request joining and leaving the engine's running batch on its own); ``name``
then names the batched policy.

Test: ``pytest tests/unit/policies/test_make_policy.py``.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from opencomposer.config import ConfigError
from opencomposer.protocols import Policy

# kind -> "module:Class"
POLICIES: dict[str, str] = {
    "oracle": "opencomposer.policies.oracle:OraclePolicy",
    "scripted": "opencomposer.policies.scripted:ScriptedPolicy",
    "openai": "opencomposer.policies.openai:OpenAIPolicy",
    "model": "opencomposer.policies.model:ModelPolicy",
    "engine": "opencomposer.policies.engine:EnginePolicy",
    "server": "opencomposer.policies.server:ServerPolicy",
    "vllm": "opencomposer.policies.vllm:VLLMPolicy",
    "sglang": "opencomposer.policies.sglang:SGLangPolicy",
}
BATCHABLE = ("model", "engine", "server", "vllm", "sglang")  # samplers of token ids, which BatchedPolicy gathers
# What each required option is, for the error that says it is missing.
EXPECTED = {
    "task": "the task (a tasks.format.Task) whose gold patch the oracle replays",
    "turns": "the canned turns: PolicyOutput, list[ToolCall] or model text each",
    "model": "the model id the endpoint serves ('openai:ID' or model=ID)",
    "engine": "an inference.engine.core.Engine with a tokenizer",
    "base_url": "the server's URL, e.g. http://host:8000/v1",
    "tokenizer": "the tokenizer that renders prompts to token ids (the model's)",
}


def policy_class(kind: str) -> type:
    """The class of ``kind``, imported now; ConfigError for a kind that is not in ``POLICIES``."""
    if kind not in POLICIES:
        raise ConfigError(f"policy spec {kind!r}: unknown kind; expected one of {', '.join(POLICIES)}")
    module, _, name = POLICIES[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def make_policy(spec: str, *, batch: int | None = None, **options: Any) -> Policy:
    """The policy ``spec`` names (``kind`` or ``kind:MODEL``), built with ``options``; see the module doc."""
    kind, colon, model = spec.partition(":")
    if colon:
        if "model" in options:
            raise ConfigError(f"policy spec {spec!r}: the model is given twice (in the spec and model=)")
        options["model"] = model
    if batch is not None and kind not in BATCHABLE:
        raise ConfigError(f"policy spec {spec!r}: batch={batch} needs a local sampler ({', '.join(BATCHABLE)}); "
                          f"{kind} policies answer one conversation at a time")
    if batch is not None and batch < 1:
        raise ConfigError(f"policy spec {spec!r}: batch: expected an integer >= 1 (episodes per generate), got {batch}")
    name = options.pop("name", None) if batch is not None else None
    cls = policy_class(kind)
    params = inspect.signature(cls).parameters
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ConfigError(f"policy spec {spec!r}: unknown option(s) {unknown}; {cls.__name__} takes "
                          f"{', '.join(params)}" + (", and batch" if kind in BATCHABLE else ""))
    for field, p in params.items():
        if p.default is inspect.Parameter.empty and field not in options:
            raise ConfigError(f"policy spec {spec!r}: missing option {field!r}: {EXPECTED.get(field, field)}")
    policy = cls(**options)
    if batch is None:
        return policy
    from opencomposer.policies.batched import BatchedPolicy

    return BatchedPolicy(policy, max_batch=batch, name=name)
