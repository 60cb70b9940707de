"""A compact decoder-only transformer for the Llama, Qwen2, Qwen3 and Qwen3-MoE families, with paged attention.

The engine runs this module instead of the Hugging Face one: its attention reads and
writes the engine's paged KV cache (``inference/models/attention.py``), and it takes a flat
batch of tokens from many sequences at once. It loads Hugging Face state dicts by their
names (``model.layers.3.self_attn.q_proj.weight``; ``hf_views`` maps each to its
parameter, or to its slice of a fused q/k/v or gate/up projection), so
``Engine.update_weights`` takes the trainer's state dict unchanged.

What differs between the families is read from the config and the state dict into a
``DecoderConfig`` (``decoder_config.py``): q/k/v biases (Qwen2), per-head RMSNorm on q and
k (Qwen3), and whether ``lm_head`` is tied to the embedding.
Qwen3-MoE layers replace the MLP by a sparse mixture of experts (``inference/models/moe.py``),
whose routes the engine records for the trainer.

    cfg = DecoderConfig.from_hf(hf_model.config, hf_model.state_dict())
    model = DecoderLM(cfg); model.load_hf_state_dict(hf_model.state_dict())

The numerics follow the HF modules (RMSNorm in fp32, rotary tables in fp32 then cast),
so that logprobs match the trainer's forward pass; tested in
``tests/unit/inference/test_model_parity.py``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from itertools import islice
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opencomposer.inference.models.attention import AttentionBatch, paged_attention
from opencomposer.inference.models.decoder_config import DecoderConfig, rope_attention_scale, rope_inv_freq
from opencomposer.inference.models.moe import Experts, SparseMoE, hf_expert_views, route_buffer

_PER_EXPERT = re.compile(r"\.experts\.\d+\.")  # a checkpoint with one module per expert


FEW_ROWS = 64  # CPU fp32 products of at most this many rows take ``Linear``'s W @ x^T form


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names), except that on the CPU in fp32 a product of
    a few rows -- a decode step, a short turn -- is computed as ``(W @ x^T)^T``: the same
    numbers up to summation order, through the BLAS's matrix-times-skinny-matrix kernel
    instead of its small-M GEMM. On the 2-core dev VM (AMD EPYC, MKL 2024.2, AVX2;
    ``benchmarks/profile_cpu_engine.py``) SmolLM2-135M's 30 layers of projections at 2-4
    rows took 30 ms instead of 68-86, 64 rows 123 instead of 148, and its lm_head at 2-4 rows
    7.3-7.5 ms instead of 28-29; one row costs the same either way, and from 256 rows the
    GEMM is faster (498 against 624 ms)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= FEW_ROWS:
            out = torch.mm(self.weight, x.t()).t().contiguous()
            return out if self.bias is None else out.add_(self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused kernel on CUDA; computes in fp32 like HF's RMSNorm (which rounds to the
        # input dtype before the weight multiply: bf16 results can differ by one ulp)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """q, k and v come from one fused projection (``qkv_proj``; HF's q/k/v_proj are slices
    of it, see ``hf_views``): one matrix multiply instead of three per layer."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.qkv_proj = Linear(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    fused = False  # Triton kernels (set by DecoderLM.use_triton)

    def forward(self, x, rope: Rope, batch: AttentionBatch, k_cache, v_cache):
        return self.o_proj(self.attend(self.qkv_proj(x), rope, batch, k_cache, v_cache))

    def attend(self, flat, rope: Rope, batch: AttentionBatch, k_cache, v_cache):
        """Fused qkv projection output [T, (H + 2 KV) * d] -> attention output [T, H * d]."""
        t = flat.shape[0]
        nh, nkv = self.num_heads, self.num_kv_heads
        qkv = flat.view(t, nh + 2 * nkv, self.head_dim)
        qk, v = qkv[:, :nh + nkv], qkv[:, nh + nkv:]
        if self.qk_norm:
            normed = torch.cat((self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])), dim=1)
            if self.fused:
                qk.copy_(normed)
            else:
                qk = normed
        if self.fused:  # rotate q, k in place and write k, v to the cache: one kernel
            from opencomposer.inference.kernels.fused import rope_and_cache

            rope_and_cache(flat, rope.cos_half, rope.sin_half, batch.slot_mapping, k_cache, v_cache, nh, nkv)
        else:
            qk = qk * rope.cos + _rotate_half(qk) * rope.sin  # rotary on q and k heads at once
        out = paged_attention(qk[:, :nh], qk[:, nh:], v, k_cache, v_cache, batch)
        return out.reshape(t, nh * self.head_dim)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    fused = False

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.fused:
            from opencomposer.inference.kernels.fused import silu_mul

            return self.down_proj(silu_mul(gate_up))
        return self.down_proj(F.silu(gate_up[:, :self.inter]) * gate_up[:, self.inter:])


class Rope:
    """Rotary tables for this step's positions: [T, 1, d] in the model dtype (torch path,
    as HF casts them) and [T, d/2] fp32 halves (Triton path)."""

    def __init__(self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, fused: bool,
                 scale: float = 1.0):
        freqs = positions.float()[:, None] * inv_freq[None, :]
        if fused:
            self.cos_half, self.sin_half = freqs.cos(), freqs.sin()
            if scale != 1.0:  # YaRN's attention factor, on the fp32 tables as HF applies it
                self.cos_half, self.sin_half = self.cos_half * scale, self.sin_half * scale
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if scale != 1.0:
                cos, sin = cos * scale, sin * scale
            self.cos, self.sin = cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def add_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, fused: bool):
    """(norm(x + residual), x + residual); the first layer has no residual yet."""
    if residual is None:
        return norm(x), x
    if fused:
        from opencomposer.inference.kernels.fused import add_rmsnorm

        return add_rmsnorm(x, residual, norm.weight, norm.eps), residual  # residual updated in place
    residual = x + residual
    return norm(residual), residual


def _norm_proj(x, residual, norm: RMSNorm, proj: nn.Linear, config):
    """(proj(norm(x + residual)), x + residual): one GEMV with ``config``, else two kernels."""
    if config:
        from opencomposer.inference.kernels.gemv import gemv

        return gemv(x, proj.weight, proj.bias, norm_weight=norm.weight, residual=residual, eps=norm.eps, config=config)
    h, residual = add_norm(x, residual, norm, True)
    return proj(h), residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.sparse = index in cfg.sparse_layers
        self.mlp = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.experts_per_token,
                             cfg.norm_topk_prob) if self.sparse else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    fused = False

    def forward(self, x, residual, rope, batch, k_cache, v_cache):
        """-> (this layer's MLP output, the residual stream before adding it)."""
        h, residual = add_norm(x, residual, self.input_layernorm, self.fused)
        h = self.self_attn(h, rope, batch, k_cache, v_cache)
        h, residual = add_norm(h, residual, self.post_attention_layernorm, self.fused)
        return (self.mlp(h, batch.slot_mapping) if self.sparse else self.mlp(h)), residual


class _Body(nn.Module):  # named "model" inside DecoderLM so parameter names match HF
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    """``forward(input_ids, positions, batch, kv) -> hidden`` over a flat token batch;
    ``logits(hidden)`` applies ``lm_head`` (in the model dtype, like HF; callers upcast)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # fp32 always, as HF does: a plain attribute, so ``model.to(bfloat16)`` leaves it alone
        # (the engine's ModelRunner moves it to the model's device)
        self.inv_freq = rope_inv_freq(cfg)
        self.rope_scale = rope_attention_scale(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                k_caches: torch.Tensor, v_caches: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rope = Rope(self.inv_freq, positions, x.dtype, self.fused, self.rope_scale)
        if self.fused and x.shape[0] <= self.gemv_rows and self.gemv_plan:
            return self._forward_gemv(x, rope, batch, k_caches, v_caches)
        residual = None
        for i, layer in enumerate(islice(self.model.layers, self._layers_run)):
            batch.layer = i
            x, residual = layer(x, residual, rope, batch, k_caches[i], v_caches[i])
        return add_norm(x, residual, self.model.norm, self.fused)[0]

    def _forward_gemv(self, x, rope, batch, k_caches, v_caches):
        """The same layers for a few rows, each projection per ``gemv_plan``: a config ->
        ``triton_gemv`` with the RMSNorm (+ residual add) or SiLU * up before it fused in;
        None -> cuBLAS after the separate fused kernel."""
        from opencomposer.inference.kernels.gemv import gemv
        from opencomposer.inference.kernels.fused import silu_mul

        plan = self.gemv_plan
        residual = None
        for i, layer in enumerate(islice(self.model.layers, self._layers_run)):
            attn, mlp = layer.self_attn, layer.mlp
            flat, residual = _norm_proj(x, residual, layer.input_layernorm, attn.qkv_proj, plan["qkv"])
            h = attn.attend(flat, rope, batch, k_caches[i], v_caches[i])
            h = gemv(h, attn.o_proj.weight, config=plan["o"]) if plan["o"] else attn.o_proj(h)
            h, residual = _norm_proj(h, residual, layer.post_attention_layernorm, mlp.gate_up_proj, plan["gate_up"])
            x = gemv(h, mlp.down_proj.weight, silu_mul=True, config=plan["down"]) if plan["down"] else \
                mlp.down_proj(silu_mul(h))
        return add_norm(x, residual, self.model.norm, True)[0]

    _layers_run: int | None = None  # ``first_layers``: forward runs only this many layers

    @contextlib.contextmanager
    def first_layers(self, n: int = 1):
        """Inside, ``forward`` runs only the first ``n`` layers (its output is then not the
        model's). For start-up's compile-only pass (``parallel_compile``): every layer launches
        the same kernel variants, so one layer queues every compile, and the eager work the
        pass also does (cuBLAS, torch ops) is one layer's, not all of them."""
        self._layers_run = n
        try:
            yield self
        finally:
            self._layers_run = None

    fused = False
    gemv_rows = 0  # with ``fused``: batches of at most this many tokens take ``_forward_gemv``
    gemv_plan: dict | None = None  # role (``triton_gemv.ROLES``) -> GEMV config, or None for cuBLAS

    def use_triton(self, on: bool = True) -> None:
        """Switch the fused Triton kernels (CUDA) on or off for every layer."""
        d = self.cfg.head_dim
        if on and (d & (d - 1)):
            raise ValueError(f"the Triton kernels need a power-of-two head_dim, got {d}")
        for m in self.modules():
            if isinstance(m, (DecoderLM, DecoderLayer, Attention, MLP, SparseMoE)):
                m.fused = on

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fused and hidden.shape[0] <= self.gemv_rows and self.gemv_plan and self.gemv_plan["lm_head"]:
            from opencomposer.inference.kernels.gemv import gemv

            return gemv(hidden, self.lm_head.weight, config=self.gemv_plan["lm_head"])
        return self.lm_head(hidden)

    def use_grouped_mm(self, on: bool = True) -> None:
        """Experts as two grouped GEMMs a layer (no host sync) instead of a loop (``moe.Experts``)."""
        self.grouped_mm = on
        for m in self.modules():
            if isinstance(m, Experts):
                m.grouped = on

    grouped_mm = False

    def route_buffer(self, num_slots: int) -> torch.Tensor | None:
        """Record every token's experts from now on (``moe.route_buffer``); None for a dense model."""
        return route_buffer(list(self.model.layers), num_slots, next(self.parameters()).device)

    def hf_views(self, per_expert: bool = False) -> dict[str, torch.Tensor]:
        """HF parameter name -> the tensor (a parameter or a slice of a fused one) holding it.
        Experts: one 3-D tensor per layer (transformers 5.x), or with ``per_expert`` one module
        per expert (transformers 4.x, published checkpoints)."""
        cfg = self.cfg
        views: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            if per_expert and ".mlp.experts." in name:
                views.update(hf_expert_views(name, p, cfg.moe_intermediate_size))
            elif ".qkv_proj." in name:
                kind = name.rsplit(".", 1)[1]
                q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
                base = name.replace("qkv_proj", "{}")
                views[base.format("q_proj")] = p.data[:q]
                views[base.format("k_proj")] = p.data[q:q + kv]
                views[base.format("v_proj")] = p.data[q + kv:]
                assert kind in ("weight", "bias")
            elif ".gate_up_proj." in name:
                base = name.replace("gate_up_proj", "{}")
                views[base.format("gate_proj")] = p.data[:cfg.intermediate_size]
                views[base.format("up_proj")] = p.data[cfg.intermediate_size:]
            else:
                views[name] = p.data
        return views

    def hf_targets(self, shapes: Mapping[str, tuple[int, ...]], partial: bool = False) -> dict[str, torch.Tensor]:
        """HF parameter name -> the tensor to write, for the names and shapes a caller will write.

        ``partial`` allows a subset of the parameters (a trainer sending only what changed);
        unknown names and shape mismatches are always errors naming the key. A tied
        ``lm_head.weight`` is dropped when the embedding is written too (one tensor)."""
        own = self.hf_views(per_expert=any(_PER_EXPERT.search(name) for name in shapes))
        tied = self.cfg.tie_word_embeddings
        out = {}
        for name, shape in shapes.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name not in own:
                raise ValueError(f"state dict key {name!r} is not a parameter of this {self.cfg.model_type} model")
            if tuple(shape) != tuple(own[name].shape):
                raise ValueError(f"state dict key {name!r}: shape {tuple(shape)}, expected {tuple(own[name].shape)}")
            if tied and name == "lm_head.weight" and "model.embed_tokens.weight" in shapes:
                continue  # the same tensor as the embedding
            out[name] = own[name]
        seen = set(out)
        if tied and seen & {"lm_head.weight", "model.embed_tokens.weight"}:
            seen |= {"lm_head.weight", "model.embed_tokens.weight"}
        missing = sorted(set(own) - seen)
        if missing and not partial:
            raise ValueError(f"state dict is missing {len(missing)} parameters, e.g. {missing[:3]}")
        return out

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor], partial: bool = False) -> None:
        """Copy HF-named tensors into this model's parameters, in place.

        In place (``copy_``), so CUDA graphs captured over these parameters stay valid. Every
        key is checked (``hf_targets``) before any weight changes.
        """
        self.write_hf(self.hf_targets({name: t.shape for name, t in state_dict.items()}, partial), state_dict)

    @staticmethod
    def write_hf(targets: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy each checked target's tensor (``hf_targets``) from ``state_dict``, in place."""
        with torch.no_grad():
            for name, own in targets.items():
                own.copy_(state_dict[name].to(device=own.device, dtype=own.dtype))


def empty_model(cfg: DecoderConfig, device: torch.device | str, dtype: torch.dtype) -> DecoderLM:
    """A ``DecoderLM`` with uninitialised weights, allocated once, in ``dtype`` on ``device``."""
    with torch.device("meta"):
        model = DecoderLM(cfg).to(dtype)
    model = model.to_empty(device=device)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def from_hf_model(hf_model: Any, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> DecoderLM:
    """A ``DecoderLM`` with the weights of an HF ``*ForCausalLM`` (copied, not shared)."""
    sd = hf_model.state_dict()
    cfg = DecoderConfig.from_hf(hf_model.config, sd)
    first = next(iter(sd.values()))
    model = empty_model(cfg, torch.device(device) if device is not None else first.device, dtype or first.dtype)
    model.load_hf_state_dict(sd)
    return model.eval()
