"""``ServerPolicy``: an ``opencomposer serve`` process behind the rollout interface of ``EnginePolicy``.

    policy = ServerPolicy("http://gpu-7:8000/v1", tokenizer, model="smollm2-135m", temperature=1.0)
    outs = policy.sample_batch([prompt_ids, ...])     # token ids, logprobs, policy version per token

Rollouts render prompts to token ids themselves (``models.chat``, as for the in-process
engine) and send them as ``/v1/completions`` prompts, one request per prompt, concurrently;
the server answers with the exact sampled ids, their logprobs and the policy version of
each token (the ``return_token_ids`` extension of ``opencomposer serve``). Weights reach the
server through a weight store (``sync/``; ``serve --weights-from``), not through this class:
``wait_for_version`` blocks until the server runs a given version. Errors name the URL.

Test: ``pytest tests/integration/test_rl_run.py -k server``.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from opencomposer.models import codec
from opencomposer.policies.model import PromptPolicy
from opencomposer.protocols import PolicyOutput


class ServerUnavailable(RuntimeError):
    """The server did not answer, answered with an error, or lacks the token-id extension."""


class ServerPolicy(PromptPolicy):
    def __init__(self, base_url: str, tokenizer: Any, *, model: str | None = None, temperature: float = 0.7,
                 top_p: float = 1.0, max_new_tokens: int = 512, seed: int | None = None, timeout: float = 600.0,
                 max_concurrency: int = 64):
        self.base = base_url.rstrip("/").removesuffix("/v1")
        self.tokenizer, self.temperature, self.top_p = tokenizer, temperature, top_p
        self.max_new_tokens, self.seed, self.timeout = max_new_tokens, seed, timeout
        self.http = httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=max_concurrency))
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="server-policy")
        models = self._call("GET", "/v1/models")["data"]
        if not models:
            raise ServerUnavailable(f"{self.base}/v1/models lists no model")
        info = next((m for m in models if m["id"] == model), None) if model else models[0]
        if info is None:
            raise ServerUnavailable(f"{self.base} serves {[m['id'] for m in models]}, not {model!r}")
        self.model, self.max_model_len = info["id"], int(info.get("max_model_len") or 0)
        self.name = f"server:{self.model}"
        self.version, self._calls = 0, 0

    def _call(self, method: str, path: str, **kw: Any) -> dict:
        try:
            r = self.http.request(method, self.base + path, **kw)
        except httpx.HTTPError as e:
            raise ServerUnavailable(f"server unreachable at {self.base}{path}: {e}") from None
        if r.status_code != 200:
            raise ServerUnavailable(f"{self.base}{path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    # ------------------------------------------------------------------ the rollout interface

    @property
    def policy_version(self) -> int:
        return self.version

    def _context(self) -> tuple[int, str]:
        return self.max_model_len, f"the server's max_model_len ({self.base})"

    def sample_batch(self, prompts: list[list[int]]) -> list[PolicyOutput]:
        calls, self._calls = self._calls, self._calls + 1
        jobs = [self.pool.submit(self._one, p, None if self.seed is None else self.seed + calls * 100_003 + i)
                for i, p in enumerate(prompts)]
        return [j.result() for j in jobs]

    def _one(self, prompt: list[int], seed: int | None) -> PolicyOutput:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self._budget(prompt),
                "temperature": self.temperature, "top_p": self.top_p, "logprobs": 0, "return_token_ids": True}
        if seed is not None:
            body["seed"] = seed
        choice = self._call("POST", "/v1/completions", json=body)["choices"][0]
        got = choice.get("opencomposer")
        if not got:
            raise ServerUnavailable(f"{self.base}/v1/completions returned no token ids: rollout.engine='server' "
                                    "needs an opencomposer serve; for vLLM or SGLang set [rollout] engine = "
                                    "'vllm' or 'sglang' (policies/vllm.py, policies/sglang.py)")
        versions = got["policy_versions"]
        text = choice["text"]
        _, tool_calls = codec.parse_tool_calls(text)
        out = PolicyOutput(text=text, tool_calls=tool_calls, prompt_tokens=len(prompt),
                           completion_tokens=len(got["token_ids"]), token_ids=got["token_ids"],
                           logprobs=got["logprobs"], policy_version=versions[0] if versions else self.version,
                           finish_reason="stop" if choice["finish_reason"] == "stop" else "length",
                           policy_versions=versions)
        if versions:
            self.version = max(self.version, versions[-1])
        return out

    # ------------------------------------------------------------------ weights

    def wait_for_version(self, version: int, timeout_s: float = 300.0) -> None:
        """Block until the server's engine runs ``version`` (applied from its weight store: a
        server that follows a store counts once its follower applied a version, so the version 0
        it loaded is not taken for the store's version 0, e.g. the weights after an SFT stage)."""
        deadline, seen = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            m = self._call("GET", "/metrics")
            seen, follows = m["engine"]["policy_version"], m.get("weights_sync")
            # a follower that has applied nothing yet runs the weights it loaded, whatever their label
            if follows is not None and follows.get("version") is None:
                seen = None
            if seen is not None and seen >= version:
                self.version = seen
                return
            time.sleep(0.05)
        sync = m.get("weights_sync")
        raise ServerUnavailable(f"{self.base} still runs policy version {seen} after {timeout_s:.0f} s, not "
                                f"{version}: is it started with --weights-from the run's [sync] store? "
                                f"(its weights_sync: {sync})")

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.http.close()
