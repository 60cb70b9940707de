"""A stand-in for an SGLang server (SGLang cannot be installed here): the native routes RL uses,
with SGLang's request and response shapes field by field, backed by a real tiny model
(``engine_standin``).

    app = SGLangStandin(Backend("tiny-random")).app     # then engine_standin.serving(app)

Shapes followed (sgl-project/sglang as stored late 2026; see ``policies/sglang.py``):

* ``POST /generate`` (``GenerateReqInput``: fields outside ``REQUEST`` / ``SAMPLING`` are refused,
  as SGLang's dataclasses refuse unknown keys): ``input_ids`` or ``text``, ``sampling_params``,
  ``return_logprob``, ``logprob_start_len``, ``return_text_in_logprobs``,
  ``return_routed_experts``. Answer: ``{"text", "output_ids", "meta_info": {"id",
  "finish_reason": {"type": "stop", "matched": id} | {"type": "length", "length": n},
  "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
  "output_token_logprobs": [[logprob, token_id, None], ...], "input_token_logprobs": [],
  "routed_experts" (base64 int32, with the server flag ``--enable-return-routed-experts``)}}``;
  ``text`` without the stop token, ``output_ids`` with it.
* ``GET /get_model_info`` -> ``{"model_path", "tokenizer_path", "is_generation",
  "preferred_sampling_params", "weight_version", "has_image_understanding",
  "has_audio_understanding"}``; ``GET /v1/models`` -> ``{"object": "list", "data": [{"id",
  "object", "created", "owned_by": "sglang", "root", "max_model_len"}]}``.
* ``POST /update_weights_from_disk`` (``UpdateWeightFromDiskReqInput``: ``model_path``,
  ``load_format``, ``abort_all_requests``, ``weight_version``...) -> ``{"success", "message",
  "num_paused_requests"}``, HTTP 200 or 400; ``POST /flush_cache`` -> plain text.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from testkit.engine_standin import Backend, Faults, routes_b64, unknown_keys

REQUEST = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
           "return_text_in_logprobs", "stream", "return_routed_experts", "lora_path"}
SAMPLING = {"max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
            "frequency_penalty", "presence_penalty", "min_new_tokens", "n", "ignore_eos", "skip_special_tokens",
            "spaces_between_special_tokens", "no_stop_trim"}
UPDATE = {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
          "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache"}


class SGLangStandin:
    def __init__(self, backend: Backend, faults: Faults | None = None, return_routed_experts: bool = False):
        self.backend, self.faults = backend, faults or Faults()
        self.return_routed_experts = return_routed_experts  # --enable-return-routed-experts
        self.weight_version = "default"  # SGLang's ServerArgs.weight_version until an update names one
        self.requests: list[dict] = []
        self.flushes = 0
        self.app = FastAPI()
        self._routes()

    def _model_path(self) -> str:
        return self.faults.served_as or self.backend.name

    def _routes(self) -> None:
        app, f = self.app, self.faults

        @app.get("/get_model_info")
        def model_info() -> dict:
            return {"model_path": self._model_path(), "tokenizer_path": self._model_path(), "is_generation": True,
                    "preferred_sampling_params": None, "weight_version": f.weight_version or self.weight_version,
                    "has_image_understanding": False, "has_audio_understanding": False}

        @app.get("/v1/models")
        def models() -> dict:
            return {"object": "list", "data": [{
                "id": self._model_path(), "object": "model", "created": int(time.time()), "owned_by": "sglang",
                "root": self._model_path(), "max_model_len": self.backend.max_model_len}]}

        @app.post("/generate")
        def generate(body: dict = Body(...)):
            self.requests.append(body)
            sp = body.get("sampling_params") or {}
            bad = unknown_keys(body, REQUEST) + unknown_keys(sp, SAMPLING)
            if bad:
                return JSONResponse({"error": {"message": f"unexpected keyword arguments {bad}"}}, status_code=400)
            prompt = body.get("input_ids")
            if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
                return JSONResponse({"error": {"message": "this stand-in takes input_ids only"}}, status_code=400)
            c = self.backend.generate(prompt, int(sp.get("max_new_tokens", 128)), float(sp.get("temperature", 1.0)),
                                      float(sp.get("top_p", 1.0)), None, sp.get("stop_token_ids") or [])
            return self._answer(body, prompt, c)

        @app.post("/update_weights_from_disk")
        def update_weights_from_disk(body: dict = Body(...)):
            if f.update_status:
                return JSONResponse({"success": False, "message": "Failed to update weights: CUDA out of memory"},
                                    status_code=f.update_status)
            bad = unknown_keys(body, UPDATE)
            if bad or not body.get("model_path"):
                return JSONResponse({"success": False, "message": f"bad request: {bad or 'model_path missing'}"},
                                    status_code=400)
            try:
                self.backend.load(body["model_path"])
            except ValueError as e:
                return JSONResponse({"success": False, "message": f"Failed to get weights iterator: {e}"},
                                    status_code=400)
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
            return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

        @app.post("/flush_cache")
        def flush_cache():
            self.flushes += 1
            return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there are "
                                     "running or waiting requests, the operation will not be performed.)\n")

    def _answer(self, body: dict, prompt: list[int], c) -> dict:
        stop = c.finish_reason == "stop"
        meta: dict = {"id": body.get("rid") or uuid.uuid4().hex,
                      "finish_reason": {"type": "stop", "matched": c.token_ids[-1]} if stop
                      else {"type": "length", "length": len(c.token_ids)},
                      "prompt_tokens": len(prompt), "completion_tokens": len(c.token_ids), "cached_tokens": 0,
                      "weight_version": self.faults.weight_version or self.weight_version, "e2e_latency": 0.01}
        out: dict = {"text": c.text, "meta_info": meta}
        if self.faults.no_token_ids:
            return out
        out["output_ids"] = list(c.token_ids)
        if body.get("return_routed_experts") and self.return_routed_experts and c.routes is not None:
            meta["routed_experts"] = routes_b64(c.routes, "int32")
        if body.get("return_logprob"):
            text = bool(body.get("return_text_in_logprobs"))
            meta["output_token_logprobs"] = [[lp, t, self.backend.tokenizer.decode([t]) if text else None]
                                             for lp, t in zip(c.logprobs, c.token_ids)]
            meta["input_token_logprobs"] = []
        return out
