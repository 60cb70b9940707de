"""Qwen3-MoE in the engine: the routes it records against Hugging Face's router on the same
weights, through the prefix cache, preemption and both checkpoint layouts (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from opencomposer.inference.engine.core import Engine, SamplingParams


def _moe(tiny_hf, seed: int = 0):
    """Both layers sparse (the family fixture's model has a dense first layer)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False,
                         initializer_range=0.25, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3MoeForCausalLM(cfg).eval()


def _hf_routes(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), sparse layers, k]: the experts HF's forward pass routes each token to."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    k = hf.config.num_experts_per_tok
    return torch.stack([torch.topk(torch.softmax(r.float(), -1), k, -1).indices for r in out.router_logits], 1)


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal expert sets per token and layer (top-k's order among near-equal scores may differ)."""
    return torch.equal(a.long().sort(-1).values, b.long().sort(-1).values)


def test_routes_are_hfs_for_every_token_the_model_ran(tiny_hf, prompts):
    hf = _moe(tiny_hf)
    engine = Engine(hf, None, max_num_seqs=4, max_model_len=128, block_size=4)
    ps = prompts(4, seed=5)
    outs = engine.generate(ps, SamplingParams(max_tokens=12, temperature=1.0, seed=7))
    seen = set()
    for p, c in zip(ps, outs):
        ids = p + c.token_ids
        assert c.routes is not None and c.routes.dtype == torch.int16
        assert tuple(c.routes.shape) == (len(ids) - 1, 2, 2)  # every token but the last sampled one
        assert _same_sets(c.routes, _hf_routes(hf, ids)[:-1])
        seen.update(c.routes.flatten().tolist())
    assert seen == set(range(8))  # the router is not degenerate: every expert is used
    assert engine.stats()["kv_blocks_used"] == 0


def test_prefix_cache_hits_keep_the_routes_they_were_computed_with(tiny_hf, prompts):
    hf = _moe(tiny_hf, seed=1)
    engine = Engine(hf, None, max_num_seqs=2, max_model_len=128, block_size=4)
    shared = prompts(1, lo=30, hi=31, seed=8)[0]
    first = engine.generate([shared], SamplingParams(max_tokens=6, temperature=0))[0]
    turn2 = shared + first.token_ids + [5, 6, 7, 8, 9]
    second = engine.generate([turn2], SamplingParams(max_tokens=6, temperature=0))[0]
    assert second.cached_prompt_tokens >= 28  # the first turn's blocks were reused, not recomputed
    assert second.routes.shape[0] == len(turn2) + len(second.token_ids) - 1
    assert torch.equal(second.routes[:len(shared)], first.routes[:len(shared)])
    assert _same_sets(second.routes, _hf_routes(hf, turn2 + second.token_ids)[:-1])


def test_preempted_sequences_are_recomputed_with_their_routes(tiny_hf, prompts):
    hf = _moe(tiny_hf, seed=2)
    ps = prompts(6, lo=20, hi=40, seed=9)
    params = SamplingParams(max_tokens=20, temperature=0)
    roomy = Engine(hf, None, max_num_seqs=6, max_model_len=64, block_size=4).generate(ps, params)
    tight = Engine(hf, None, max_num_seqs=6, max_model_len=64, block_size=4, kv_blocks=40)
    outs = tight.generate(ps, params)
    assert tight.stats()["preemptions"] > 0
    for a, b in zip(roomy, outs):
        assert a.token_ids == b.token_ids
        assert _same_sets(a.routes, b.routes)
    assert tight.stats()["kv_blocks_used"] == 0


def test_per_expert_checkpoints_load_and_update_in_place(tiny_hf, prompts):
    hf = _moe(tiny_hf, seed=3)
    sd = hf.state_dict()
    per_expert = {}
    for name, t in sd.items():  # transformers 4.x / published safetensors: one module per expert
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[:-len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                per_expert[f"{base}{e}.gate_proj.weight"] = t[e, :inter]
                per_expert[f"{base}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[:-len("down_proj")]
            for e in range(t.shape[0]):
                per_expert[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            per_expert[name] = t
    engine = Engine(hf, None, max_num_seqs=2, max_model_len=64, block_size=4)
    p = prompts(1, seed=10)
    ref = engine.generate(p, SamplingParams(max_tokens=8, temperature=0))[0]
    model = engine.model
    for prm in model.parameters():
        prm.data.zero_()
    model.load_hf_state_dict(per_expert)
    again = engine.generate(p, SamplingParams(max_tokens=8, temperature=0))[0]
    assert again.token_ids == ref.token_ids and torch.equal(again.routes, ref.routes)
    # an in-flight update of one expert of one layer, by its per-expert name
    key = "model.layers.1.mlp.experts.5.down_proj.weight"
    engine.update_weights({key: torch.zeros_like(per_expert[key])}, version=1)
    assert model.model.layers[1].mlp.experts.down_proj[5].abs().sum() == 0
    assert model.model.layers[1].mlp.experts.down_proj[4].abs().sum() > 0
    with pytest.raises(ValueError, match=r"experts\.5\.down_proj\.weight.*shape \(3, 3\), expected \(64, 48\)"):
        engine.update_weights({key: torch.zeros(3, 3)}, version=2)
    with pytest.raises(ValueError, match=r"experts\.9\.up_proj\.weight.*not a parameter"):
        engine.update_weights({"model.layers.0.mlp.experts.9.up_proj.weight": torch.zeros(48, 64)}, version=2)


def test_dense_models_record_no_routes(tiny_hf, prompts):
    engine = Engine(tiny_hf("qwen3"), None, max_num_seqs=2, max_model_len=64)
    assert engine.runner.routes is None
    assert engine.generate(prompts(1), SamplingParams(max_tokens=3))[0].routes is None


def test_grouped_gemms_loop_and_graph_buffers_agree(tiny_hf, prompts):
    """The experts as grouped GEMMs (the default where they run) and as a loop, and the decode
    graphs' static-buffer path (``cuda_graphs="eager"``), give the same tokens and routes."""
    hf = _moe(tiny_hf, seed=4)
    ps = prompts(5, seed=11)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    grouped = Engine(hf, None, max_num_seqs=4, max_model_len=96, block_size=4)
    assert grouped.stats()["moe_experts"] == "grouped_mm"
    loop = Engine(hf, None, max_num_seqs=4, max_model_len=96, block_size=4)
    loop.model.use_grouped_mm(False)
    assert loop.stats()["moe_experts"] == "loop"
    graphs = Engine(hf, None, max_num_seqs=4, max_model_len=96, block_size=4, cuda_graphs="eager")
    runs = [e.generate(ps, params) for e in (grouped, loop, graphs)]
    for outs in runs[1:]:
        for a, b in zip(runs[0], outs):
            assert a.token_ids == b.token_ids and torch.equal(a.routes, b.routes)
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert Engine(tiny_hf("qwen3"), None, max_model_len=64).stats()["moe_experts"] is None
