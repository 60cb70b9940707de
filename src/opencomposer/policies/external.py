"""What the vLLM and SGLang rollout clients share (``policies/vllm.py``, ``policies/sglang.py``):
token ids in, token ids and logprobs out, new weights pushed from a directory, each token
tagged with the weights version the server acknowledged.

    policy = make_policy("vllm", base_url="http://gpu-7:8000/v1", tokenizer=tok, model="Qwen/Qwen3-8B")
    policy.push_weights(WeightsDir(...).write(state, 3), version=3)   # the server now runs version 3
    outs = policy.sample_batch([prompt_ids, ...])   # exact ids, logprobs, policy_version == 3

Rollouts render prompts to token ids themselves (``models.chat``, as for every local sampler)
and send the ids; the ids and logprobs sampled come back through each server's documented
fields (never re-tokenised text, which drifts in multi-turn tool use). The text is decoded here
from those ids, as the built-in engine does. At start the server must serve the run's model
(refused otherwise, naming both); it must be given the trainer's weights (``push_weights``)
before it samples, so no token is tagged with a version nobody knows.

MoE router replay: ``experts_per_token=k`` asks the server for the experts each token was routed to;
``check_routes`` refuses a server that does not return them (the caller may allow that
explicitly: then replay is off for its tokens).

Only synchronous use is supported: weights are pushed between collections, while no request
is in flight, so the version of a collection's tokens is the one acknowledged before it.

Test: ``pytest tests/unit/policies/test_external_engines.py tests/integration/test_rl_external_engines.py``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from opencomposer.models import codec
from opencomposer.models.chat import stop_token_ids
from opencomposer.policies.model import PromptPolicy
from opencomposer.protocols import PolicyOutput


class EngineError(RuntimeError):
    """An external engine failed, refused, or answered without what RL needs; names its URL."""


class ExternalPolicy(PromptPolicy):
    """A vLLM or SGLang server behind the rollout interface of ``EnginePolicy``; subclasses give
    ``kind``, ``_served`` (the model check), ``_request`` (one prompt -> one ``Sampled``) and
    ``_update`` (load a weights directory, return the version the server acknowledges)."""

    kind = "external"

    def __init__(self, base_url: str, tokenizer: Any, *, model: str | None = None, temperature: float = 0.7,
                 top_p: float = 1.0, max_new_tokens: int = 512, seed: int | None = None, timeout: float = 600.0,
                 max_concurrency: int = 64, experts_per_token: int = 0):
        self.base = base_url.rstrip("/").removesuffix("/v1")
        self.tokenizer, self.temperature, self.top_p = tokenizer, temperature, top_p
        # MoE (> 0): ask for each token's experts (``experts_per_token`` a layer), for router replay
        self.max_new_tokens, self.seed, self.experts_per_token = max_new_tokens, seed, experts_per_token
        self.http = httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=max_concurrency))
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix=f"{self.kind}-policy")
        # the end-of-turn ids the built-in engine stops at, sent so the server stops there too
        self.stop_ids = sorted(stop_token_ids(SimpleNamespace(generation_config=None), tokenizer))
        self.version: int | None = None  # acknowledged by the server (push_weights); None: unknown
        self._calls = 0
        try:
            self.model, self.max_model_len = self._served(model)
            if self.max_model_len < 1:  # the per-turn budget and the context rule need it
                raise self.missing("/v1/models", "max_model_len", "data[].max_model_len, the server's context size")
        except BaseException:
            self.close()
            raise
        self.name = f"{self.kind}:{self.model}"

    # ------------------------------------------------------------------ HTTP

    def where(self, path: str = "") -> str:
        return f"{self.kind} engine at {self.base}{path}"

    def call(self, method: str, path: str, **kw: Any) -> Any:
        """One request; an ``EngineError`` naming the engine, the path, and the HTTP status and
        body when it is not a 200."""
        try:
            r = self.http.request(method, self.base + path, **kw)
        except httpx.HTTPError as e:
            raise EngineError(f"{self.where(path)} unreachable: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise EngineError(f"{self.where(path)}: HTTP {r.status_code}: {r.text[:500]}")
        try:
            return r.json() if r.content else {}
        except ValueError:  # e.g. SGLang's /flush_cache answers plain text
            return {"text": r.text}

    def missing(self, path: str, field: str, hint: str) -> EngineError:
        return EngineError(f"{self.where(path)} answered without {field}: {hint}")

    # ------------------------------------------------------------------ the rollout interface

    @property
    def policy_version(self) -> int:
        return -1 if self.version is None else self.version

    def _context(self) -> tuple[int, str]:
        return self.max_model_len, f"the max_model_len of the {self.where()}"

    def sample_batch(self, prompts: list[list[int]]) -> list[PolicyOutput]:
        if self.version is None:
            raise EngineError(f"{self.where()}: its weights version is unknown; push the trainer's weights "
                              "(push_weights) before sampling, so every token is tagged with a known version")
        calls, self._calls = self._calls, self._calls + 1
        jobs = [self.pool.submit(self._one, p, None if self.seed is None else self.seed + calls * 100_003 + i)
                for i, p in enumerate(prompts)]
        return [j.result() for j in jobs]

    def _one(self, prompt: list[int], seed: int | None) -> PolicyOutput:
        version = self.version
        ids, logprobs, finish, routes = self._request(prompt, self._budget(prompt), seed)
        if len(logprobs) != len(ids):
            raise EngineError(f"{self.where()}: {len(ids)} token ids but {len(logprobs)} logprobs")
        text = self.tokenizer.decode(ids[:-1] if finish == "stop" and ids and ids[-1] in self.stop_ids else ids,
                                     skip_special_tokens=False)
        _, tool_calls = codec.parse_tool_calls(text)
        return PolicyOutput(text=text, tool_calls=tool_calls, prompt_tokens=len(prompt), completion_tokens=len(ids),
                            token_ids=ids, logprobs=logprobs, policy_version=version, finish_reason=finish,
                            routes=routes, policy_versions=[version] * len(ids), prompt_ids=list(prompt))

    def _check_prompt(self, sent: list[int], echoed: list[int] | None, path: str, field: str) -> None:
        """The prompt ids the server reports running are the ones sent (no re-tokenisation)."""
        if echoed is not None and list(echoed) != list(sent):
            raise EngineError(f"{self.where(path)} ran other prompt ids than were sent ({field}: "
                              f"{len(echoed)} ids, sent {len(sent)}); it must take token ids as they are")

    # ------------------------------------------------------------------ weights and routes

    def push_weights(self, path: str | Path, version: int) -> None:
        """Make the server load the weights in directory ``path`` (a ``WeightsDir`` version) and
        tag later tokens with ``version`` once the server acknowledges it."""
        try:
            got = self._update(str(Path(path).resolve()), int(version))
        except EngineError as e:
            raise EngineError(f"weight update to version {version} from {path} failed: {e}") from None
        if got != int(version):
            raise EngineError(f"{self.where()} acknowledged weights version {got!r} after loading {path}, "
                              f"not {version}")
        self.version = got

    def check_routes(self) -> bool:
        """Whether the server returns the experts each token was routed to (one short request)."""
        prompt = self.tokenizer.encode("hi", add_special_tokens=False) or [0]
        return bool(self._request(prompt, 1, 0)[3])

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.http.close()

    # ------------------------------------------------------------------ per server

    def _served(self, model: str | None) -> tuple[str, int]:  # pragma: no cover - subclasses
        raise NotImplementedError

    def _request(self, prompt: list[int], max_tokens: int, seed: int | None
                 ) -> tuple[list[int], list[float], str, str]:  # pragma: no cover - subclasses
        """(completion ids, their logprobs, "stop" | "length", encoded routes or "")."""
        raise NotImplementedError

    def _update(self, path: str, version: int) -> int:  # pragma: no cover - subclasses
        raise NotImplementedError


def same_model(expected: str, *served: str | None) -> bool:
    """``expected`` (a name, hub id or path) names one of ``served`` (ids or paths), exactly or
    by its last path part (a hub id served from a local copy)."""
    names = [s.rstrip("/") for s in served if s]
    want = expected.rstrip("/")
    return want in names or Path(want).name in {Path(n).name for n in names}


def routes_text(arr: Any) -> str:
    """Expert ids ``[tokens - 1, layers, k]`` (a numpy array) as ``models.moe_replay.encode_routes`` text."""
    import torch

    from opencomposer.models.moe_replay import encode_routes

    return encode_routes(torch.from_numpy(arr.astype("int16")))
