"""What the vLLM and SGLang stand-ins share (``vllm_standin.py``, ``sglang_standin.py``): a real
tiny model behind them, so token ids are real, weights reloaded from a directory, faults on
request, and a uvicorn thread on a free loopback port.

    with serving(VLLMStandin(Backend("tiny-random")).app) as url:   # http://127.0.0.1:PORT
        ...

The backend is the built-in engine (``inference/engine``) on ``load_model(name)``: each request
is run to completion under a lock (no batching: the stand-ins check wire shapes, not speed).
``load(path)`` reads a directory's safetensors (``front.load_weights_dir``) into the engine, as a
real server's reload from disk does.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse


@dataclass
class Faults:
    """What a stand-in gets wrong on purpose (the bad-input tests)."""

    no_token_ids: bool = False  # answer text only, without the token-id fields
    update_status: int = 0  # answer weight updates with this HTTP status (e.g. 500)
    served_as: str | None = None  # report serving this model instead of the one loaded
    weight_version: str | None = None  # report this version on every response (a server that lies)


def routes_b64(routes, fmt: str) -> str:
    """The engine's ``Completion.routes`` ([tokens - 1, layers, k]) as a server sends them: vLLM's
    base64 ``.npy`` ("npy"), SGLang's base64 of little-endian int32 ``[tokens - 1, layers * k]``."""
    import base64
    import io

    import numpy as np

    arr = routes.numpy()
    if fmt == "npy":
        buf = io.BytesIO()
        np.save(buf, arr.astype(np.int32))
        return base64.b64encode(buf.getvalue()).decode("ascii")
    return base64.b64encode(arr.reshape(arr.shape[0], -1).astype("<i4").tobytes()).decode("ascii")


class Backend:
    """A tiny real model in the built-in engine, and the weights version a server reports."""

    def __init__(self, model: str = "tiny-random", max_model_len: int = 2048):
        from opencomposer.inference.engine.core import Engine

        self.name = model
        self.engine = Engine.from_name(model, max_num_seqs=4, max_model_len=max_model_len, device="cpu",
                                       cuda_graphs=False)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.lock = threading.Lock()
        self.loaded: list[str] = []  # directories loaded, in order
        self.answers: list[tuple[list[int], list[int], list[float]]] = []  # (prompt, ids, logprobs) sampled

    def generate(self, prompt: list[int], max_tokens: int, temperature: float, top_p: float,
                 seed: int | None, stop_token_ids: list[int]) -> Any:
        from opencomposer.inference.engine.core import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                stop_token_ids=tuple(stop_token_ids))
        with self.lock:
            c = self.engine.generate([prompt], params)[0]
            self.answers.append((list(prompt), list(c.token_ids), list(c.logprobs)))
        return c

    def load(self, path: str) -> None:
        from opencomposer.inference.server.front import load_weights_dir

        sd = load_weights_dir(path)  # ValueError for a directory without safetensors
        with self.lock:
            self.engine.update_weights(sd, self.engine.policy_version + 1)
        self.loaded.append(path)


def error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    """An error body in the OpenAI shape both servers use for their OpenAI routes."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def unknown_keys(body: dict, allowed: set[str]) -> list[str]:
    return sorted(set(body) - allowed)


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` on a free 127.0.0.1 port in a daemon thread; yields its base URL."""
    import uvicorn

    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        while not uv.started:
            assert thread.is_alive(), "stand-in did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(10)
