"""Router replay: the trainer's forward pass sends each token to the experts the sampler chose.

A mixture-of-experts model's output depends on a discrete choice per token and layer (its
top-k experts). The sampler and the trainer compute the router's scores with different
kernels, and in asynchronous RL with different weights (the sampler is a few versions
behind), so near-equal scores can fall either way: a token routed to other experts in the
trainer has the logprob of another network, and the importance ratio of that token is noise.
Replaying the sampler's routes (recorded by the engine, ``inference/models/moe.py``) removes that:
the trainer's router still computes its probabilities, so the router learns, but the top-k
*selection* is the recorded one, and the gate weights are the trainer's probabilities of
those experts (renormalised when the model does). Tokens without a record (the id -1: the
last sampled token of a turn, tokens another policy produced) route as usual.

    with replay_routes(model, routes):        # routes [B, T, sparse layers, k], -1 = free
        logits = model(input_ids).logits

Works on Hugging Face models whose routers return ``(logits, weights, experts)``
(transformers 5.x ``Qwen3MoeTopKRouter``), also inside a peft wrapper. Routes travel in
trajectories as text (``encode_routes`` / ``decode_routes``: int16, base64); a turn that
continues the previous one keeps only the routes of its new tokens (``routes_after``), so a
transcript holds each token's routes once, not once per turn.

Test: ``pytest tests/unit/models/test_moe_replay.py``.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

NO_ROUTE = -1


def routers(model: Any) -> list[torch.nn.Module]:
    """The model's top-k routers, in layer order (empty for a dense model)."""
    found = [m for name, m in model.named_modules()
             if name.endswith("mlp.gate") and hasattr(m, "top_k") and hasattr(m, "norm_topk_prob")]
    if not found and any(name.endswith("mlp.experts") for name, _ in model.named_modules()):
        raise TypeError("router replay needs routers that return (logits, weights, experts), as transformers 5.x's "
                        "Qwen3MoeTopKRouter does; this model's experts have no such router (an older transformers?)")
    return found


@contextlib.contextmanager
def replay_routes(model: Any, routes: torch.Tensor | None) -> Iterator[None]:
    """Inside, the model's forward routes token t of row b in sparse layer j to
    ``routes[b, t, j]`` (where that row of k ids is not -1). ``routes`` None: no change."""
    if routes is None:
        yield
        return
    found = routers(model)
    if routes.dim() != 4 or routes.shape[2] != len(found) or (found and routes.shape[3] != found[0].top_k):
        k = found[0].top_k if found else 0
        raise ValueError(f"routes of shape {tuple(routes.shape)}: expected [batch, tokens, {len(found)} sparse "
                         f"layers, {k} experts] for this model")
    handles = [r.register_forward_hook(_replay_hook(routes[:, :, j])) for j, r in enumerate(found)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _replay_hook(layer_routes: torch.Tensor):
    def hook(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        logits, _, chosen = output
        want = layer_routes.reshape(-1, layer_routes.shape[-1]).to(device=chosen.device, dtype=chosen.dtype)
        if want.shape[0] != chosen.shape[0]:
            raise ValueError(f"router replay: the forward pass has {chosen.shape[0]} tokens, the routes "
                             f"{want.shape[0]} (batch x tokens must match the input)")
        recorded = (want >= 0).all(dim=-1, keepdim=True)
        experts = torch.where(recorded, want, chosen)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights = probs.gather(-1, experts)
        if module.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts

    return hook


def pad_routes(per_row: list[torch.Tensor | None], length: int) -> torch.Tensor | None:
    """Rows' routes ([n_i, layers, k], n_i <= length) -> [rows, length, layers, k], -1 padded;
    None when no row has routes."""
    known = [r for r in per_row if r is not None]
    if not known:
        return None
    out = torch.full((len(per_row), length, *known[0].shape[1:]), NO_ROUTE, dtype=torch.long)
    for i, r in enumerate(per_row):
        if r is not None:
            out[i, :r.shape[0]] = r[:length]
    return out


def encode_routes(routes: torch.Tensor) -> str:
    """[n, layers, k] expert ids -> ``"n,layers,k:<base64 of little-endian int16>"``."""
    shape = ",".join(map(str, routes.shape))
    data = routes.to(torch.int16).numpy().astype("<i2").tobytes()
    return f"{shape}:{base64.b64encode(data).decode('ascii')}"


def routes_after(text: str, start: int) -> str:
    """Encoded routes without their first ``start`` tokens (a turn's routes past what the
    previous turn of the conversation already recorded)."""
    return encode_routes(decode_routes(text)[start:])


def decode_routes(text: str) -> torch.Tensor:
    """The inverse of ``encode_routes``; a clear error for anything else."""
    try:
        head, data = text.split(":", 1)
        shape = tuple(int(x) for x in head.split(","))
        arr = np.frombuffer(base64.b64decode(data, validate=True), dtype="<i2").reshape(shape)
    except (ValueError, TypeError) as e:
        raise ValueError(f"routes {text[:40]!r}...: expected 'n,layers,k:<base64 int16>' ({e})") from e
    return torch.from_numpy(arr.astype(np.int16))
