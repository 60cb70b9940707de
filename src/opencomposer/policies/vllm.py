"""``VLLMPolicy``: a ``vllm serve`` process as the RL rollout engine, token ids in and out.

    vllm serve Qwen/Qwen3-8B --enable-prefix-caching      # with VLLM_SERVER_DEV_MODE=1 (weight updates)
    policy = VLLMPolicy("http://gpu-7:8000/v1", tokenizer, model="Qwen/Qwen3-8B")

The fields used, as vLLM defines them (read from vllm-project/vllm main as stored late 2026:
``vllm/entrypoints/openai/completion/protocol.py`` at 002032ee (``CompletionRequest``,
``CompletionResponseChoice``), ``vllm/entrypoints/serve/dev/rlhf/api_router.py`` at 0100a212,
the ``/collective_rpc`` router (``vllm/entrypoints/serve/dev/rpc``), ``GPUModelRunner.
reload_weights(weights_iterator=None, weights_path=None, is_checkpoint_format=True)``; docs:
docs.vllm.ai/en/latest/training/weight_transfer/ and the examples/rl/rlhf_http_*.py pages; no
single vLLM release was checked, so a server older than these fields is refused by name):

* ``POST /v1/completions`` with ``prompt`` a list of token ids (taken as ids, not re-tokenised),
  ``logprobs: 0`` (the sampled token's logprob only), ``return_token_ids: true`` (the response's
  ``choices[0].token_ids`` and ``choices[0].prompt_token_ids``) and ``return_tokens_as_token_ids:
  true`` (``choices[0].logprobs.tokens`` as ``"token_id:{id}"``, for servers without
  ``return_token_ids``), ``stop_token_ids`` (the chat's end-of-turn ids), ``skip_special_tokens:
  false``. Logprobs come from ``choices[0].logprobs.token_logprobs``. The ids of both fields must
  agree, the prompt ids echoed must be those sent. ``prompt_logprobs`` is not asked for: the
  trainer recomputes every logprob it trains on.
* MoE routes: ``choices[0].routed_experts`` (base64 ``.npy``, ``[tokens - 1, layers, k]``),
  present when the server runs with ``--enable-return-routed-experts``.
* The model: ``GET /v1/models`` -> ``data[].id`` (served name), ``root`` (path), ``max_model_len``.
* Weights (``VLLM_SERVER_DEV_MODE=1``): ``POST /collective_rpc`` ``{"method": "reload_weights",
  "kwargs": {"weights_path": DIR}}`` (each worker's ``reload_weights(weights_path=...)`` reads the
  directory's safetensors), ``POST /reset_prefix_cache`` (no KV of the old weights is reused),
  ``POST /update_weight_version`` ``{"new_version": "N"}``; ``GET /weight_info`` ->
  ``{"weight_version": "N"}`` is the version acknowledged.

Tested against a stand-in only (``tests/testkit/vllm_standin.py``), not a real vLLM.

Test: ``pytest tests/unit/policies/test_external_engines.py -k vllm``.
"""

from __future__ import annotations

import base64
import io
from typing import Any

from opencomposer.policies.external import EngineError, ExternalPolicy, routes_text, same_model

TOKEN_ID = "token_id:"


class VLLMPolicy(ExternalPolicy):
    kind = "vllm"

    def _served(self, model: str | None) -> tuple[str, int]:
        cards = self.call("GET", "/v1/models").get("data") or []
        if not cards:
            raise EngineError(f"{self.where('/v1/models')} lists no model")
        card = next((c for c in cards if same_model(model, c.get("id"), c.get("root"))), None) if model else cards[0]
        if card is None:
            served = ", ".join(f"{c.get('id')!r} (root {c.get('root')!r})" for c in cards)
            raise EngineError(f"{self.where('/v1/models')} serves {served}, not the run's model {model!r}: "
                              "rollouts must come from the model being trained")
        return card["id"], int(card.get("max_model_len") or 0)

    def _request(self, prompt: list[int], max_tokens: int, seed: int | None
                 ) -> tuple[list[int], list[float], str, str]:
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "stop_token_ids": self.stop_ids, "skip_special_tokens": False}
        if seed is not None:
            body["seed"] = seed
        path = "/v1/completions"
        choices = self.call("POST", path, json=body).get("choices") or []
        if not choices:
            raise self.missing(path, "choices", "an empty completion response")
        c = choices[0]
        lp = c.get("logprobs") or {}
        ids = _ids_of(lp.get("tokens"), self, path)
        if c.get("token_ids") is not None:
            if ids is not None and list(c["token_ids"]) != ids:
                raise EngineError(f"{self.where(path)}: choices[0].token_ids and the ids in logprobs.tokens differ")
            ids = list(c["token_ids"])
        if ids is None:
            raise self.missing(path, "token ids", "choices[0].token_ids (request field return_token_ids) and "
                               "choices[0].logprobs.tokens as 'token_id:N' (return_tokens_as_token_ids) are both "
                               "absent; RL needs the exact ids sampled, not text")
        logprobs = lp.get("token_logprobs")
        if logprobs is None or any(x is None for x in logprobs):
            raise self.missing(path, "logprobs", "choices[0].logprobs.token_logprobs (request field logprobs: 0)")
        self._check_prompt(prompt, c.get("prompt_token_ids"), path, "choices[0].prompt_token_ids")
        routes = _routes(c.get("routed_experts"), self, path) if self.experts_per_token else ""
        return ids, [float(x) for x in logprobs], "stop" if c.get("finish_reason") == "stop" else "length", routes

    def _update(self, path: str, version: int) -> int:
        try:
            self.call("POST", "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": path}})
        except EngineError as e:
            if ": HTTP 404" in str(e):
                raise EngineError(f"{e} (the weight endpoints need the server started with "
                                  "VLLM_SERVER_DEV_MODE=1)") from None
            raise
        self.call("POST", "/reset_prefix_cache")
        self.call("POST", "/update_weight_version", json={"new_version": str(version)})
        got = self.call("GET", "/weight_info").get("weight_version")
        try:
            return int(got)
        except (TypeError, ValueError):
            raise EngineError(f"{self.where('/weight_info')}: weight_version {got!r} is not the version sent "
                              f"({version})") from None


def _ids_of(tokens: list[str] | None, policy: VLLMPolicy, path: str) -> list[int] | None:
    if tokens is None:
        return None
    if not all(isinstance(t, str) and t.startswith(TOKEN_ID) for t in tokens):
        raise policy.missing(path, "token ids in logprobs.tokens", "expected 'token_id:N' strings (request field "
                             f"return_tokens_as_token_ids), got e.g. {tokens[:3]!r}")
    return [int(t[len(TOKEN_ID):]) for t in tokens]


def _routes(data: str | None, policy: VLLMPolicy, path: str) -> str:
    if not data:
        return ""
    import numpy as np

    try:
        arr = np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
    except ValueError as e:
        raise EngineError(f"{policy.where(path)}: choices[0].routed_experts is not base64 .npy: {e}") from None
    return routes_text(arr)
