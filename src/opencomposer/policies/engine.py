"""``EnginePolicy``: the engine behind the same interface as ``policies.model.ModelPolicy``.

Rollouts call ``act`` / ``encode`` / ``sample_batch`` and read ``policy_version``; this class
answers them from an ``Engine`` instead of HF ``generate``, so ``policies.batched.BatchedPolicy``
(or anything written against ``ModelPolicy``) can use continuous batching, the paged KV
cache and the prefix cache unchanged::

    engine = Engine.from_name("smollm2-135m")
    policy = EnginePolicy(engine, temperature=0.7, max_new_tokens=256, seed=0)
    out = policy.act([Message("user", "Say hello")], tools=[])
    out.token_ids, out.logprobs, out.policy_version

Same prompt builder (``models.chat``), same context rule (``ContextLengthError`` when the
prompt leaves no room; the budget shrinks to the room left otherwise), same stop tokens
(``models.chat.stop_token_ids``), same token fields. Two differences, both documented
in ``engine.py``: ``logprobs`` are taken before top-k/top-p truncation (identical when
those are off), and with in-flight weight updates one turn may span two policy versions:
``policy_version`` is then the version of the turn's first token (the oldest), and
``PolicyOutput.policy_versions`` gives the version per token.

Hook for ``rl/``: ``BatchedPolicy(EnginePolicy(engine, ...))`` serves concurrent episodes
continuously (its worker owns the engine: ``add_request`` with ``next_params``, ``step``,
``output`` of each finished request); where ``rl/run.py`` sets
``policy.policy_version = trainer.version`` after a step (enough for ``ModelPolicy``, which
shares the trainer's model), an engine needs ``policy.update_weights(model.state_dict(),
version)`` instead -- setting the version alone raises, so stale weights cannot be
mislabelled as new.

Seeds (with ``seed``): row i of sampling call n draws ``seed + n * 100_003 + i`` with a
generator of its own; a call is one ``sample_batch`` (``act`` too), or one request in
``BatchedPolicy``'s continuous mode (``next_params``). ``_calls`` counts them, and a resumed
RL run continues the count (``rl/run.py``).

Test: ``pytest tests/unit/policies/test_engine_policy.py``.
"""

from __future__ import annotations

from typing import Any

from opencomposer.models import codec
from opencomposer.inference.engine.core import Engine, SamplingParams
from opencomposer.inference.engine.outputs import Completion
from opencomposer.models.moe_replay import encode_routes
from opencomposer.policies.model import PromptPolicy
from opencomposer.protocols import PolicyOutput


class EnginePolicy(PromptPolicy):
    def __init__(self, engine: Engine, *, temperature: float = 0.7, top_p: float = 1.0, top_k: int = 0,
                 max_new_tokens: int = 512, seed: int | None = None, name: str | None = None):
        if engine.tokenizer is None:
            raise ValueError("EnginePolicy needs an engine with a tokenizer (render prompts, decode text)")
        SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k).check()
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.name = name or str(getattr(engine.model.cfg, "model_type", "engine"))
        self._calls = 0

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        # ModelPolicy shares the trainer's model object, so a trainer only bumps the version;
        # the engine holds its own copy of the weights, which must travel with the version.
        raise AttributeError("EnginePolicy.policy_version follows the engine's weights: call "
                             "update_weights(state_dict, version) instead of setting it")

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """New weights (HF names, e.g. ``trainer_model.state_dict()``) for the next engine step."""
        self.engine.update_weights(state_dict, version)

    def sample_batch(self, prompts: list[list[int]]) -> list[PolicyOutput]:
        params = [self._params(p, self._seed(self._calls, i)) for i, p in enumerate(prompts)]
        self._calls += 1
        return [self.output(c) for c in self.engine.generate(prompts, params)]

    def next_params(self, prompt_ids: list[int]) -> SamplingParams:
        """One request's sampling params, the request counted as a call of its own (the seed
        ``act`` would draw for it): ``BatchedPolicy``'s continuous mode adds each request to the
        engine with these, in the order its worker takes them."""
        params = self._params(prompt_ids, self._seed(self._calls, 0))
        self._calls += 1
        return params

    def _seed(self, call: int, row: int) -> int | None:
        return None if self.seed is None else self.seed + call * 100_003 + row

    def _params(self, prompt_ids: list[int], seed: int | None) -> SamplingParams:
        return SamplingParams(max_tokens=self._budget(prompt_ids), temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=seed)

    def _context(self) -> tuple[int, str]:
        return self.engine.max_model_len, "the engine's max_model_len"

    def output(self, c: Completion) -> PolicyOutput:
        """The ``PolicyOutput`` of one finished engine request."""
        _, calls = codec.parse_tool_calls(c.text)
        return PolicyOutput(
            text=c.text, tool_calls=calls, prompt_tokens=len(c.prompt_token_ids), completion_tokens=len(c.token_ids),
            token_ids=c.token_ids, logprobs=c.logprobs,
            policy_version=c.policy_versions[0] if c.policy_versions else self.engine.policy_version,
            finish_reason="stop" if c.finish_reason == "stop" else "length",
            routes=encode_routes(c.routes) if c.routes is not None else "",
            policy_versions=c.policy_versions, prompt_ids=c.prompt_token_ids)
