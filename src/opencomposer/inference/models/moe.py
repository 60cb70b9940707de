"""Mixture-of-experts layers (the Qwen3-MoE family) and the routes the engine records.

A sparse layer sends each token to ``top_k`` of ``num_experts`` SwiGLU experts: the router
(``gate``, one linear map) scores the experts, a softmax in fp32 and a top-k pick them, and
the token's output is the experts' outputs weighted by their probabilities (renormalised over
the k when ``norm_topk_prob``), as Hugging Face's ``Qwen3MoeSparseMoeBlock`` computes it.
Parameter names and layouts are HF's (transformers 5.x: ``mlp.gate.weight`` [E, H],
``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]); checkpoints
with one module per expert (``mlp.experts.3.up_proj.weight``, transformers 4.x and the
published safetensors) load through slices of the same tensors (``hf_expert_views``).

**Routes.** Which experts a token went to is part of what the sampler computed: if the
trainer's forward pass routes a token elsewhere (other kernels, a weight update in flight),
its logprobs are those of another network, and RL's importance ratios pay for it. So the
engine records every token's experts: one small buffer indexed like the KV cache (slot ->
[sparse layer, k] expert ids), written by the same ``slot_mapping`` as the K/V, so that
tokens served from the prefix cache keep the routes they were computed with.
``read_routes`` reads one sequence's; ``Completion.routes`` carries them to the trainer,
whose forward pass then reuses them (``opencomposer.models.moe_replay``).

The experts run on tokens sorted by expert: two grouped GEMMs a layer (``torch._grouped_mm``,
as torchtitan's MoE does) where the build supports them for the model's device and dtype,
else a loop over the experts that got tokens. Only the grouped GEMMs' native kernel (bf16 on
Hopper or later) runs without a host sync, so only there does a MoE engine use CUDA graphs.
On CUDA with the Triton kernels, steps of a few tokens (decode) skip the sort and take three
Triton kernels instead (``triton_moe.py``: 1.2-1.7x faster decode at 1-16 tokens).

Test: ``pytest tests/unit/inference/test_moe.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opencomposer.inference.engine.block_manager import kv_slots

ROUTE_DTYPE = torch.int16  # expert ids (up to 32,767 experts)


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs as two 3-D weights (HF's ``Qwen3MoeExperts`` layout).

    Tokens are sorted by expert and multiplied group by group: with ``torch._grouped_mm``
    (two grouped GEMMs a layer, no host sync, so CUDA graphs can capture it) where it runs
    for this device and dtype, else a loop over the experts that got tokens."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.inter = inter

    grouped = False  # set by ``use_grouped_mm``

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], idx / weights [T, k] -> sum over k of weights * expert(x)."""
        t, k = idx.shape
        idx, perm = idx.sort(dim=-1)  # each token's experts in ascending order, as HF adds them up
        weights = weights.gather(1, perm)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        xs = x.index_select(0, order // k)
        out = self._grouped(xs, flat) if self.grouped else self._loop(xs, flat)
        out.mul_(weights.reshape(-1, 1).index_select(0, order))
        back = torch.empty_like(out)
        back[order] = out
        return back.view(t, k, -1).sum(dim=1)

    def _grouped(self, xs: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int32, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate_up = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs)
        h = F.silu(gate_up[:, :self.inter]) * gate_up[:, self.inter:]
        return torch._grouped_mm(h, self.down_proj.transpose(1, 2), offs=offs)

    def _loop(self, xs: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()  # a host sync
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate_up = F.linear(xs[start:start + n], self.gate_up_proj[e])
                h = F.silu(gate_up[:, :self.inter]) * gate_up[:, self.inter:]
                out[start:start + n] = F.linear(h, self.down_proj[e])
                start += n
        return out


def grouped_mm_capturable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether CUDA graphs can capture ``torch._grouped_mm`` here: its native kernel (bf16 on a
    Hopper-or-later GPU). Elsewhere it falls back to a loop that copies the group offsets to
    the host (measured on an H100 in fp32: the capture fails), so the engine runs eagerly."""
    return (device.type == "cuda" and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device) >= (9, 0))


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here and agrees with a loop (some builds and GPUs
    support it for a few dtypes only)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 32, generator=g).to(device, dtype)
    w = torch.randn(3, 16, 32, generator=g).to(device, dtype)
    offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)
    try:
        got = torch._grouped_mm(x, w.transpose(1, 2), offs=offs).float()
    except (RuntimeError, NotImplementedError):
        return False
    want = torch.cat([x[:8] @ w[0].T, x[8:] @ w[2].T]).float()
    return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()))


class SparseMoE(nn.Module):
    """A Qwen3-MoE sparse MLP block: ``forward(x, slots)``; with ``routes`` set (a [slots, k]
    view of the engine's route buffer) it writes each token's experts at its KV slot."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, inter)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.routes: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], their weights [T, k] in x's dtype), as HF's ``Qwen3MoeTopKRouter``."""
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return idx, weights.to(x.dtype)

    fused = False  # Triton kernels for a few tokens (``triton_moe.py``; set by DecoderLM.use_triton)

    def forward(self, x: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        if self.fused:
            from opencomposer.inference.kernels.moe import (
                FUSED_MAX_TOKENS,
                moe_experts,
                moe_route,
            )

            if x.shape[0] <= FUSED_MAX_TOKENS:
                idx, weights = moe_route(F.linear(x, self.gate.weight), self.top_k, self.norm_topk_prob, x.dtype,
                                         self.routes, slots)
                return moe_experts(x, idx, weights, self.experts.gate_up_proj, self.experts.down_proj)
        idx, weights = self.route(x)
        if self.routes is not None and slots is not None:
            self.routes.index_copy_(0, slots, idx.to(ROUTE_DTYPE))
        return self.experts(x, idx, weights)


def hf_expert_views(name: str, p: torch.Tensor, inter: int) -> dict[str, torch.Tensor]:
    """HF names -> slices of the 3-D expert weight ``name`` (``...mlp.experts.gate_up_proj`` or
    ``...down_proj``) for checkpoints with one module per expert."""
    base, kind = name.rsplit(".", 1)
    views = {}
    for e in range(p.shape[0]):
        if kind == "gate_up_proj":
            views[f"{base}.{e}.gate_proj.weight"] = p.data[e, :inter]
            views[f"{base}.{e}.up_proj.weight"] = p.data[e, inter:]
        else:
            views[f"{base}.{e}.down_proj.weight"] = p.data[e]
    return views


def route_buffer(layers: list[Any], num_slots: int, device: torch.device) -> torch.Tensor | None:
    """A [sparse layers, num_slots, k] buffer for these decoder layers' routes (None if none
    is sparse), each ``SparseMoE`` given its layer's [num_slots, k] view to write into."""
    sparse = [layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoE)]
    if not sparse:
        return None
    buf = torch.full((len(sparse), num_slots, sparse[0].top_k), -1, dtype=ROUTE_DTYPE, device=device)
    for i, moe in enumerate(sparse):
        moe.routes = buf[i]
    return buf


def read_routes(buf: torch.Tensor, block_table: list[int], n: int, block_size: int) -> torch.Tensor:
    """The routes of a sequence's first ``n`` tokens: [n, sparse layers, k], copied on the
    buffer's device (queued after the steps that wrote them; no host sync)."""
    slots = kv_slots(torch.tensor(block_table, dtype=torch.long), torch.arange(n), block_size)
    return buf.index_select(1, slots.to(buf.device)).permute(1, 0, 2)
