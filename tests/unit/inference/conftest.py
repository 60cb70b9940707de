"""Tiny Llama / Qwen2 / Qwen3 / Qwen3-MoE models built in-test (random weights, fixed seed, fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),  # != hidden / heads, as in real Qwen3
    # 8 experts, 2 a token; layer 0 dense, layer 1 sparse (as ``mlp_only_layers`` allows)
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                                        "moe_intermediate_size": 48, "norm_topk_prob": True,
                                                        "mlp_only_layers": [0]}),
}


def tiny_hf(family: str, seed: int = 0, vocab: int = 97, tie: bool = True):
    """A 2-layer, hidden-64 model of ``family``; a larger init spread than the default so
    greedy outputs vary instead of repeating one token."""
    config_cls, model_cls, extra = FAMILIES[family]
    cfg = config_cls(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     tie_word_embeddings=tie, initializer_range=0.25, bos_token_id=1, eos_token_id=2,
                     pad_token_id=0, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg)
        if family == "qwen2":  # HF inits biases to zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.25)
    return model.eval()


def prompts(n: int, vocab: int = 97, seed: int = 1, lo: int = 5, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


@pytest.fixture(name="tiny_hf")
def _tiny_hf_fixture():
    return tiny_hf


@pytest.fixture(name="prompts")
def _prompts_fixture():
    return prompts


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param
