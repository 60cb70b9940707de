"""Router replay on a tiny Qwen3-MoE (fp32, CPU): the engine samples and records routes, the
trainer's forward pass on perturbed weights reuses them."""

from __future__ import annotations

import pytest
import torch

from opencomposer.inference.engine.core import Engine, SamplingParams
from opencomposer.models.moe_replay import (
    decode_routes,
    encode_routes,
    pad_routes,
    replay_routes,
    routers,
)


def _moe(seed: int = 0, norm: bool = True, experts: int = 8):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                         num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=norm,
                         mlp_only_layers=[1], initializer_range=0.25, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3MoeForCausalLM(cfg).eval()


def _rollout(hf, n: int = 3, seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 97, (int(k),), generator=g).tolist() for k in torch.randint(8, 30, (n,), generator=g)]
    engine = Engine(hf, None, max_num_seqs=n, max_model_len=128, block_size=4)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=11))
    rows = [p + c.token_ids for p, c in zip(prompts, outs)]
    return prompts, outs, rows


def _chosen(model, ids, routes=None):
    """The experts each router of ``model`` picked (after any replay), [1, T, layers, k]."""
    seen = []
    with replay_routes(model, routes):
        hooks = [r.register_forward_hook(lambda m, a, out: seen.append(out[2])) for r in routers(model)]
        try:
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits
        finally:
            for h in hooks:
                h.remove()
    return torch.stack(seen, 1)[None], logits


def _sampled_logprobs(logits, prompt, completion):
    lp = torch.log_softmax(logits[0, len(prompt) - 1:-1].float(), -1)
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0]


def _perturb_routers(model, scale: float, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in routers(model):
            r.weight.add_(scale * torch.randn(r.weight.shape, generator=g))


def test_replaying_the_models_own_routes_changes_nothing():
    hf = _moe()
    _, outs, rows = _rollout(hf)
    for c, ids in zip(outs, rows):
        own, plain = _chosen(hf, ids)
        rec = pad_routes([c.routes], len(ids))
        assert torch.equal(rec[0, :-1].sort(-1).values, own[0, :-1].sort(-1).values)
        again, replayed = _chosen(hf, ids, rec)
        assert torch.allclose(replayed, plain, atol=1e-5, rtol=0)
        assert torch.equal(again[0, -1], own[0, -1])  # the last token has no record: routed as usual


def test_replay_keeps_the_samplers_experts_when_the_trainers_weights_moved():
    hf = _moe(seed=1)
    prompts, outs, rows = _rollout(hf, seed=6)
    _perturb_routers(hf, 0.01)
    # the trainer is a step ahead of the sampler: its routers moved a little (std 0.01 against
    # the weights' 0.25), enough to re-route ~17 of 100 tokens (measured), which then carry
    # most of the logprob mismatch (max ~2.5 nats without replay, ~0.3 with)
    moved, free_gap, replay_gap = 0, [], []
    for p, c, ids in zip(prompts, outs, rows):
        rec = pad_routes([c.routes], len(ids))
        free, free_logits = _chosen(hf, ids)
        kept, kept_logits = _chosen(hf, ids, rec)
        assert torch.equal(kept[0, :-1], rec[0, :-1])  # every recorded token went to its recorded experts
        moved += int((free[0, :-1].sort(-1).values != rec[0, :-1].sort(-1).values).any(-1).any(-1).sum())
        sampler = torch.tensor(c.logprobs)
        free_gap.append((_sampled_logprobs(free_logits, p, c.token_ids) - sampler).abs())
        replay_gap.append((_sampled_logprobs(kept_logits, p, c.token_ids) - sampler).abs())
    assert moved >= 5  # the perturbation did re-route tokens, so the comparison means something
    free_gap, replay_gap = torch.cat(free_gap), torch.cat(replay_gap)
    assert replay_gap.mean() < 0.5 * free_gap.mean(), (replay_gap.mean(), free_gap.mean())
    assert replay_gap.max() < 0.5 * free_gap.max(), (replay_gap.max(), free_gap.max())


def test_the_router_still_learns_under_replay():
    hf = _moe(seed=2, norm=False)
    _, outs, rows = _rollout(hf, n=1)
    ids, rec = rows[0], pad_routes([outs[0].routes], len(rows[0]))
    hf.train()
    with replay_routes(hf, rec):
        hf(torch.tensor([ids])).logits.float().logsumexp(-1).mean().backward()
    for r in routers(hf):
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    hf.zero_grad()


def test_unrecorded_rows_route_freely_and_shapes_are_checked():
    hf = _moe(seed=3)
    _, outs, rows = _rollout(hf, n=1)
    ids, rec = rows[0], pad_routes([outs[0].routes], len(rows[0]))
    other = (rec + 1) % 8  # different experts everywhere ...
    other[0, ::2] = -1  # ... except every other token, left to the router
    free, _ = _chosen(hf, ids)
    got, _ = _chosen(hf, ids, other)
    # (in the first sparse layer only: later layers see hidden states the forced tokens changed)
    assert torch.equal(got[0, ::2, 0], free[0, ::2, 0])
    assert torch.equal(got[0, 1::2], other[0, 1::2])
    with pytest.raises(ValueError, match=r"expected \[batch, tokens, 2 sparse layers, 2 experts\]"), \
            replay_routes(hf, rec[:, :, :1]):
        pass
    with pytest.raises(ValueError, match="batch x tokens must match"):
        _chosen(hf, ids[:-3], rec)


def test_routes_round_trip_as_text_and_bad_text_is_named():
    r = torch.randint(-1, 128, (7, 48, 8), dtype=torch.int16)
    assert torch.equal(decode_routes(encode_routes(r)), r)
    with pytest.raises(ValueError, match="expected 'n,layers,k:<base64 int16>'"):
        decode_routes("7,48:AAAA")
    assert pad_routes([None, None], 4) is None
