"""Qwen3-MoE in the engine on CUDA: greedy tokens, routes and logprobs against Hugging Face on the
same weights (fp32; bf16 with the experts as grouped GEMMs inside CUDA graphs), and the trainer
replaying the routes.

Run on a GPU box: ``PYTHONPATH=src python -m pytest -q tests/gpu/test_moe_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

from opencomposer.inference.engine.core import Engine, SamplingParams
from opencomposer.models.moe_replay import pad_routes, replay_routes, routers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _moe(dtype=torch.float32, seed: int = 0):
    """3 layers (the middle one dense), 16 experts, 4 a token, head_dim 32, on the GPU."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, norm_topk_prob=True,
                         mlp_only_layers=[1], initializer_range=0.1, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg).to(device="cuda", dtype=dtype).eval()


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (int(k),), generator=g).tolist() for k in torch.randint(5, 60, (n,), generator=g)]


def _hf(hf, ids):
    with torch.inference_mode():
        out = hf(torch.tensor([ids], device="cuda"), output_router_logits=True)
    k = hf.config.num_experts_per_tok
    routes = torch.stack([torch.topk(torch.softmax(r.float(), -1), k, -1).indices for r in out.router_logits], 1)
    return out.logits[0].float(), routes.cpu()


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_moe_fp32_matches_hf_tokens_routes_and_logprobs(kernels):
    hf = _moe()
    engine = Engine(hf, None, max_num_seqs=8, max_model_len=256, kernels=kernels)
    st = engine.stats()
    # fp32: grouped GEMMs run through torch's fallback, which syncs with the host: no graphs
    assert st["kernels"] == kernels and st["moe_experts"] in ("grouped_mm", "loop")
    assert st["cuda_graph_batch_sizes"] == []
    print(f"fp32 {kernels}: experts {st['moe_experts']}")
    ps = _prompts(8, seed=1)
    outs = engine.generate(ps, SamplingParams(max_tokens=16, temperature=1.0, seed=2))
    diffs = []
    for p, c in zip(ps, outs):
        ids = p + c.token_ids
        logits, routes = _hf(hf, ids)
        assert torch.equal(c.routes.long().sort(-1).values, routes[:-1].sort(-1).values)
        lp = torch.log_softmax(logits[len(p) - 1:-1], -1).gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])
        diffs.append((lp[:, 0].cpu() - torch.tensor(c.logprobs)).abs())
    d = torch.cat(diffs)
    assert d.mean().item() <= 1e-3, d.mean().item()
    greedy = engine.generate(ps[:3], SamplingParams(max_tokens=12, temperature=0))
    for p, c in zip(ps[:3], greedy):
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
        assert c.token_ids == ref
    assert engine.stats()["kv_blocks_used"] == 0


def test_moe_bf16_routes_replay_in_the_trainers_forward():
    hf = _moe(dtype=torch.bfloat16, seed=3)
    engine = Engine(hf, None, max_num_seqs=8, max_model_len=256)
    st = engine.stats()
    # bf16 on an H100: grouped GEMMs, so decode and prefill run as CUDA graphs
    assert st["moe_experts"] == "grouped_mm" and st["cuda_graph_batch_sizes"] == [1, 2, 4, 8], st
    assert st["prefill_graphs"] > 0 and st["run_ahead"]
    ps = _prompts(6, seed=4)
    outs = engine.generate(ps, SamplingParams(max_tokens=16, temperature=1.0, seed=5))
    agree, total, free_gap, replay_gap = 0, 0, [], []
    for p, c in zip(ps, outs):
        ids = p + c.token_ids
        logits, routes = _hf(hf, ids)
        agree += int((c.routes.long().sort(-1).values == routes[:-1].sort(-1).values).all(-1).sum())
        total += c.routes.shape[0] * c.routes.shape[1]
        rec = pad_routes([c.routes], len(ids)).cuda()
        seen = []
        with replay_routes(hf, rec), torch.inference_mode():
            hooks = [r.register_forward_hook(lambda m, a, out: seen.append(out[2])) for r in routers(hf)]
            replayed = hf(torch.tensor([ids], device="cuda")).logits[0].float()
            for h in hooks:
                h.remove()
        assert torch.equal(torch.stack(seen, 1)[:-1].cpu(), rec[0, :-1].cpu())  # the sampler's experts, exactly
        target = torch.tensor(c.token_ids, device="cuda")[:, None]
        sampler = torch.tensor(c.logprobs)
        for gap, lg in ((free_gap, logits), (replay_gap, replayed)):
            gap.append((torch.log_softmax(lg[len(p) - 1:-1], -1).gather(1, target)[:, 0].cpu() - sampler).abs())
    print(f"bf16 route agreement without replay {agree}/{total}; |logprob diff| mean free "
          f"{torch.cat(free_gap).mean():.4f} replayed {torch.cat(replay_gap).mean():.4f}")
    assert agree / total >= 0.9
    assert torch.cat(replay_gap).mean() < 0.05


def test_moe_bf16_graphs_give_the_eager_engines_tokens_and_routes():
    hf = _moe(dtype=torch.bfloat16, seed=6)
    ps = _prompts(6, seed=7)
    params = SamplingParams(max_tokens=16, temperature=0)
    graphs = Engine(hf, None, max_num_seqs=8, max_model_len=256)
    eager = Engine(hf, None, max_num_seqs=8, max_model_len=256, cuda_graphs=False)
    assert graphs.stats()["cuda_graph_batch_sizes"] and not eager.stats()["cuda_graph_batch_sizes"]
    for a, b in zip(graphs.generate(ps, params), eager.generate(ps, params)):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.routes, b.routes)
    assert graphs.stats()["kv_blocks_used"] == eager.stats()["kv_blocks_used"] == 0
