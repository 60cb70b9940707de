"""A stand-in for ``vllm serve`` (vLLM cannot be installed here): the routes RL uses, with vLLM's
request and response shapes field by field, backed by a real tiny model (``engine_standin``).

    app = VLLMStandin(Backend("tiny-random")).app     # then engine_standin.serving(app)

Shapes followed (vllm-project/vllm main as stored late 2026; see ``policies/vllm.py``):

* ``GET /v1/models``: ``{"object": "list", "data": [{"id", "object": "model", "created",
  "owned_by": "vllm", "root", "parent", "max_model_len", "permission"}]}``.
* ``POST /v1/completions`` (``CompletionRequest``; fields outside those listed in ``REQUEST``
  are refused here, so the client sends only vLLM's): ``prompt`` as token ids; ``logprobs: N``
  gives ``choices[0].logprobs = {"text_offset", "token_logprobs", "tokens", "top_logprobs"}``,
  tokens as ``"token_id:{id}"`` with ``return_tokens_as_token_ids``; ``return_token_ids`` adds
  ``choices[0].token_ids`` and ``choices[0].prompt_token_ids``; ``finish_reason`` "stop" |
  "length"; ``choices[0].routed_experts`` (base64 ``.npy``; with ``return_routed_experts``, the
  server flag ``--enable-return-routed-experts``); ``usage``. The stop token is in ``token_ids``,
  not in ``text`` (vLLM's default).
* Dev-mode routes (``VLLM_SERVER_DEV_MODE=1``; ``dev_mode=False`` gives 404s as vLLM does):
  ``POST /collective_rpc`` ``{"method", "args", "kwargs", "timeout"}`` -> ``{"results": [...]}``
  (``reload_weights`` with ``kwargs.weights_path`` reloads the directory), ``POST
  /reset_prefix_cache``, ``POST /update_weight_version`` ``{"new_version"}`` -> ``{"success",
  "new_version"}``, ``GET /weight_info`` -> ``{"weight_version"}``.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse, Response

from testkit.engine_standin import Backend, Faults, error, routes_b64, unknown_keys

REQUEST = {  # CompletionRequest fields this stand-in takes (a subset of vLLM's)
    "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "logprobs", "n", "stream", "echo", "stop",
    "stop_token_ids", "skip_special_tokens", "return_token_ids", "return_tokens_as_token_ids", "prompt_logprobs",
    "include_stop_str_in_output", "ignore_eos", "user", "add_special_tokens"}


class VLLMStandin:
    def __init__(self, backend: Backend, faults: Faults | None = None, dev_mode: bool = True,
                 served_model_name: str | None = None, return_routed_experts: bool = False):
        self.backend, self.faults = backend, faults or Faults()
        self.return_routed_experts = return_routed_experts  # --enable-return-routed-experts
        self.served = served_model_name or backend.name
        self.weight_version: str | None = None  # vLLM's until an update names one
        self.requests: list[dict] = []  # every completion request body, for the tests
        self.app = FastAPI()
        self._routes(dev_mode)

    def _routes(self, dev_mode: bool) -> None:
        app, f = self.app, self.faults

        @app.get("/v1/models")
        def models() -> dict:
            name = f.served_as or self.served
            return {"object": "list", "data": [{
                "id": name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                "root": f.served_as or self.backend.name, "parent": None,
                "max_model_len": self.backend.max_model_len, "permission": []}]}

        @app.post("/v1/completions")
        def completions(body: dict = Body(...)):  # a plain def: generation runs in FastAPI's thread pool
            self.requests.append(body)
            bad = unknown_keys(body, REQUEST)
            if bad:
                return error(400, f"unknown fields {bad}")
            if body.get("model") not in (None, self.served):
                return error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
            prompt = body.get("prompt")
            if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
                return error(400, "this stand-in takes token-id prompts only")
            c = self.backend.generate(prompt, int(body.get("max_tokens") or 16), float(body.get("temperature", 1.0)),
                                      float(body.get("top_p", 1.0)), body.get("seed"), body.get("stop_token_ids") or [])
            return self._completion(body, prompt, c)

        @app.post("/collective_rpc")
        def collective_rpc(body: dict = Body(...)):
            if not dev_mode:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            if body.get("method") is None:
                return JSONResponse({"detail": "Missing 'method' in request body"}, status_code=400)
            if f.update_status:
                return JSONResponse({"error": "Failed to load weights: CUDA out of memory"},
                                    status_code=f.update_status)
            if body["method"] != "reload_weights":
                return JSONResponse({"error": f"Worker has no method {body['method']!r}"}, status_code=500)
            try:
                self.backend.load((body.get("kwargs") or {})["weights_path"])
            except (KeyError, ValueError) as e:
                return JSONResponse({"error": f"reload_weights failed: {e}"}, status_code=500)
            return {"results": [None]}

        @app.post("/reset_prefix_cache")
        def reset_prefix_cache():
            return Response(status_code=200 if dev_mode else 404)

        @app.post("/update_weight_version")
        def update_weight_version(body: dict = Body(...)):
            if not dev_mode:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            self.weight_version = str(body["new_version"])
            return {"success": True, "new_version": self.weight_version}

        @app.get("/weight_info")
        def weight_info():
            if not dev_mode:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return {"weight_version": f.weight_version or self.weight_version}

    def _completion(self, body: dict, prompt: list[int], c) -> dict:
        tok, f = self.backend.tokenizer, self.faults
        choice: dict = {"index": 0, "text": c.text, "logprobs": None,
                        "finish_reason": "stop" if c.finish_reason == "stop" else "length", "stop_reason": None,
                        "prompt_logprobs": None, "routed_experts": None}
        if self.return_routed_experts and c.routes is not None:
            choice["routed_experts"] = routes_b64(c.routes, "npy")
        if body.get("logprobs") is not None and not f.no_token_ids:
            as_ids = bool(body.get("return_tokens_as_token_ids"))
            tokens = [f"token_id:{t}" if as_ids else tok.decode([t]) for t in c.token_ids]
            offsets, at = [], 0
            for t in c.token_ids:
                offsets.append(at)
                at += len(tok.decode([t]))
            choice["logprobs"] = {"text_offset": offsets, "token_logprobs": list(c.logprobs), "tokens": tokens,
                                  "top_logprobs": [{s: lp} for s, lp in zip(tokens, c.logprobs)]}
        if body.get("return_token_ids") and not f.no_token_ids:
            choice["token_ids"], choice["prompt_token_ids"] = list(c.token_ids), list(prompt)
        n = len(c.token_ids)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.served, "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}}
