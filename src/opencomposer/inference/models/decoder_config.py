"""The decoder's shape, read from a Hugging Face config: ``DecoderConfig`` and the rotary
frequencies it implies (``rope_inv_freq``), for the engine's model (``transformer.py``).

What differs between the families is read from the config and the state dict: Qwen2 has
q/k/v biases (found as ``*.q_proj.bias`` keys), Qwen3 has per-head RMSNorm on q and k
(``*.q_norm.weight``), Qwen3-MoE lists its sparse layers, and Llama 3.x or YaRN (a context
extended, ``train/long_context.py``) scale the rotary frequencies (``rope_scaling``; YaRN also
the tables, ``rope_attention_scale``).

    cfg = DecoderConfig.from_hf(hf_model.config, hf_model.state_dict())

Test: ``pytest tests/unit/inference/test_model_parity.py tests/unit/train/test_long_context.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # llama3-style scaling, as items
    # mixture of experts (Qwen3-MoE): the layers whose MLP is sparse, and its shape
    sparse_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    @classmethod
    def from_hf(cls, config: Any, state_dict: Mapping[str, torch.Tensor] | None = None) -> DecoderConfig:
        """Read an HF ``LlamaConfig``/``Qwen2Config``/``Qwen3Config`` (transformers 4.x or 5.x)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED:
            raise ValueError(f"model_type {model_type!r} is not supported by the engine; expected one of {SUPPORTED}")
        keys = set(state_dict or ())
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type in ("llama3", "yarn"):
            scaling = tuple(sorted((k, v) for k, v in rope.items() if k not in ("rope_theta", "type")))
            scaling += (("rope_type", rope_type),) if "rope_type" not in rope else ()
        elif rope_type not in ("default", None):
            raise ValueError(f"rope_type {rope_type!r} is not supported by the engine; expected 'default', 'llama3' "
                             "or 'yarn'")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor below 1 is not supported by the engine")
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported by the engine")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        qkv_bias = ("model.layers.0.self_attn.q_proj.bias" in keys) if keys else (
            model_type == "qwen2" or bool(getattr(config, "attention_bias", False)))
        qk_norm = ("model.layers.0.self_attn.q_norm.weight" in keys) if keys else model_type.startswith("qwen3")
        moe = {}
        if model_type == "qwen3_moe" and config.num_experts > 0:
            step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or ())
            moe = {"sparse_layers": tuple(i for i in range(config.num_hidden_layers)
                                          if i not in dense and (i + 1) % step == 0),
                   "num_experts": config.num_experts, "experts_per_token": config.num_experts_per_tok,
                   "moe_intermediate_size": config.moe_intermediate_size,
                   "norm_topk_prob": bool(config.norm_topk_prob)}
            if getattr(config, "hidden_act", "silu") != "silu":
                raise ValueError(f"hidden_act={config.hidden_act!r} is not supported by the engine; expected 'silu'")
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            rope_scaling=scaling,
            **moe,
        )

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(N, K) of each projection's weight: qkv, o, gate_up, down (per layer) and lm_head."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return {"qkv": (qkv, self.hidden_size), "o": (self.hidden_size, self.num_heads * self.head_dim),
                "gate_up": (2 * self.intermediate_size, self.hidden_size),
                "down": (self.hidden_size, self.intermediate_size), "lm_head": (self.vocab_size, self.hidden_size)}


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim / 2], fp32, as HF computes them: plain, Llama
    3.x's scaling, or YaRN's (``yarn_inv_freq``)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = dict(cfg.rope_scaling or ())
    if s.get("rope_type") == "yarn":
        return yarn_inv_freq(inv, s, d, cfg.rope_theta)
    if s:  # Llama 3.x frequency scaling, as in HF's _compute_llama3_parameters
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv
        low_wl, high_wl = old / low, old / high
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def yarn_inv_freq(inv: torch.Tensor, s: Mapping[str, Any], d: int, theta: float) -> torch.Tensor:
    """YaRN (Peng et al. 2023, arXiv:2309.00071): each frequency interpolated (divided by
    ``factor``) or kept, by how many turns it makes over the original context. Dimensions that
    turn more than ``beta_fast`` times keep their frequency, those under ``beta_slow`` turns are
    interpolated, and a linear ramp blends the dimensions between (their bounds rounded outwards
    unless ``truncate`` is false)."""
    factor, old = float(s["factor"]), float(s["original_max_position_embeddings"])
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(turns: float) -> float:  # the dimension whose wavelength fits ``turns`` times in ``old``
        return d * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no division by zero
    keep = 1 - ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return (inv / factor) * (1 - keep) + inv * keep


def rope_attention_scale(cfg: DecoderConfig) -> float:
    """What the rotary tables are multiplied by: 1, or YaRN's attention factor (given, or
    0.1 ln(factor) + 1, or the ratio of two such terms with ``mscale`` / ``mscale_all_dim``)."""
    s = dict(cfg.rope_scaling or ())
    if s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])

    def mscale(m: float = 1.0) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(float(s["mscale"])) / mscale(float(s["mscale_all_dim"]))
    return mscale()
