"""``SGLangPolicy``: an SGLang server as the RL rollout engine, token ids in and out.

    python -m sglang.launch_server --model-path Qwen/Qwen3-8B [--enable-return-routed-experts]
    policy = SGLangPolicy("http://gpu-7:30000", tokenizer, model="Qwen/Qwen3-8B")

The native API, as SGLang documents it (read from sgl-project/sglang as stored late 2026:
docs/basic_usage/native_api.ipynb at 06c48ca8 (``/generate``, ``/get_model_info``,
``/flush_cache``, ``/update_weights_from_disk``), docs/basic_usage/sampling_params.md at
0a0dd359 (``GenerateReqInput`` and ``SamplingParams`` fields), and in the source
``managers/io_struct.py`` (``UpdateWeightFromDiskReqInput``: ``model_path``, ``load_format``,
``abort_all_requests``, ``weight_version``; ``UpdateWeightFromDiskReqOutput``: ``success``,
``message``, ``num_paused_requests``) and ``managers/tokenizer_manager.py`` (``meta_info`` with
``weight_version``, ``output_token_logprobs``, ``routed_experts``); no single release was checked):

* ``POST /generate`` with ``input_ids`` (the prompt ids, used as they are), ``sampling_params``
  (``temperature``, ``top_p``, ``max_new_tokens``, ``stop_token_ids``, ``skip_special_tokens:
  false``), ``return_logprob: true`` (``logprob_start_len`` left at its default: output tokens
  only). The sampled ids and logprobs are read from ``meta_info.output_token_logprobs``, a list
  of ``(logprob, token_id, text)`` (text None: ``return_text_in_logprobs`` is off), checked
  against ``output_ids`` when present; ``meta_info.prompt_tokens`` must be the number of ids
  sent; ``meta_info.weight_version`` must be the version acknowledged; ``meta_info.finish_reason``
  is ``{"type": "stop" | "length" | "abort", ...}``. No seed is sent (not a documented
  ``sampling_params`` field in the pages read).
* MoE routes: ``return_routed_experts: true`` (server flag ``--enable-return-routed-experts``) ->
  ``meta_info.routed_experts``, base64 of little-endian int32 ``[tokens - 1, layers * k]``.
* The model: ``GET /get_model_info`` -> ``model_path``; ``GET /v1/models`` -> ``max_model_len``.
* Weights: ``POST /update_weights_from_disk`` ``{"model_path": DIR, "weight_version": "N"}`` ->
  ``{"success": true, ...}`` (a failure is ``success: false`` with a ``message``, HTTP 400), then
  ``POST /flush_cache`` (the update flushes it too; done explicitly so no old KV survives any
  version); ``GET /get_model_info`` -> ``weight_version`` is the version acknowledged.

Tested against a stand-in only (``tests/testkit/sglang_standin.py``), not a real SGLang.

Test: ``pytest tests/unit/policies/test_external_engines.py -k sglang``.
"""

from __future__ import annotations

import base64
from typing import Any

from opencomposer.policies.external import EngineError, ExternalPolicy, routes_text, same_model


class SGLangPolicy(ExternalPolicy):
    kind = "sglang"

    def _served(self, model: str | None) -> tuple[str, int]:
        path = self.call("GET", "/get_model_info").get("model_path")
        if not path:
            raise self.missing("/get_model_info", "model_path", "the path or hub id the server loaded")
        cards = self.call("GET", "/v1/models").get("data") or []
        if model and not same_model(model, path, *(c.get("id") for c in cards)):
            raise EngineError(f"{self.where('/get_model_info')} serves {path!r}, not the run's model {model!r}: "
                              "rollouts must come from the model being trained")
        return path, int(next((c.get("max_model_len") for c in cards if c.get("max_model_len")), 0) or 0)

    def _request(self, prompt: list[int], max_tokens: int, seed: int | None
                 ) -> tuple[list[int], list[float], str, str]:
        body: dict[str, Any] = {
            "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"temperature": self.temperature, "top_p": self.top_p, "max_new_tokens": max_tokens,
                                "stop_token_ids": self.stop_ids, "skip_special_tokens": False}}
        if self.experts_per_token:
            body["return_routed_experts"] = True
        path = "/generate"
        out = self.call("POST", path, json=body)
        meta = out.get("meta_info") if isinstance(out, dict) else None
        if not isinstance(meta, dict):
            raise self.missing(path, "meta_info", f"got keys {sorted(out) if isinstance(out, dict) else out!r}")
        triples = meta.get("output_token_logprobs")
        if triples is None:
            raise self.missing(path, "token ids", "meta_info.output_token_logprobs ((logprob, token_id, text) per "
                               "token; request field return_logprob) is absent; RL needs the exact ids sampled, "
                               "not text")
        ids, logprobs = [int(t[1]) for t in triples], [float(t[0]) for t in triples]
        if out.get("output_ids") is not None and list(out["output_ids"]) != ids:
            raise EngineError(f"{self.where(path)}: output_ids and meta_info.output_token_logprobs' ids differ")
        if meta.get("prompt_tokens") is not None and int(meta["prompt_tokens"]) != len(prompt):
            raise EngineError(f"{self.where(path)} ran {meta['prompt_tokens']} prompt tokens, sent {len(prompt)}: "
                              "it must take input_ids as they are")
        if self.version is not None and str(meta.get("weight_version")) != str(self.version):
            raise EngineError(f"{self.where(path)} sampled with weights version {meta.get('weight_version')!r}, "
                              f"not the acknowledged {self.version}: its tokens' version is unknown")
        reason = meta.get("finish_reason") or {}
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind == "abort":
            raise EngineError(f"{self.where(path)} aborted the request: {reason}")
        routes = self._routes(meta.get("routed_experts"), len(prompt) + len(ids) - 1)
        return ids, logprobs, "stop" if kind == "stop" else "length", routes

    def _routes(self, data: str | None, tokens: int) -> str:
        if not self.experts_per_token or not data:
            return ""
        import numpy as np

        flat = np.frombuffer(base64.b64decode(data), dtype="<i4")
        k = self.experts_per_token
        if tokens <= 0 or flat.size % (tokens * k):
            raise EngineError(f"{self.where('/generate')}: meta_info.routed_experts holds {flat.size} ids, not "
                              f"{tokens} tokens x layers x {k} experts")
        return routes_text(flat.reshape(tokens, -1, k))

    def _update(self, path: str, version: int) -> int:
        got = self.call("POST", "/update_weights_from_disk", json={"model_path": path, "weight_version": str(version)})
        if not got.get("success"):
            raise EngineError(f"{self.where('/update_weights_from_disk')}: success={got.get('success')!r}: "
                              f"{got.get('message')!r}")
        self.call("POST", "/flush_cache")
        ack = self.call("GET", "/get_model_info").get("weight_version")
        try:
            return int(ack)
        except (TypeError, ValueError):
            raise EngineError(f"{self.where('/get_model_info')}: weight_version {ack!r} is not the version sent "
                              f"({version})") from None
