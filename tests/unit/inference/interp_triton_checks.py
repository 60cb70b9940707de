"""Triton kernels checked on the CPU through Triton's interpreter -- run by
``test_triton_cpu.py`` in a subprocess with ``TRITON_INTERPRET=1`` (the variable must be
set before Triton is imported, so these cannot run in the main test process).

Checks: the small-batch GEMV with its fused prologues against torch ops; a whole decode
step of a tiny Qwen2 through the fused path (rope + cache write, paged decode, GEMV
projections per a plan) against the torch path; the paged prefill kernel (with and
without key splits, and its start-up warm-up) against dense causal attention; the paged
decode kernel against the torch path. The same kernels run compiled on a GPU in
``tests/gpu/test_engine_cuda.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_triton_cpu.py (needs TRITON_INTERPRET=1 before Triton is imported)",
                allow_module_level=True)

import triton.runtime.interpreter as _interp

_original_patch = _interp._patch_lang_tensor


def _patched(tensor, scope):  # Triton 3.6's interpreter calls int() on 1-element arrays, which numpy 2 refuses
    _original_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interp._patch_lang_tensor = _patched


@pytest.fixture
def interpreted():
    from opencomposer.inference.kernels import fused as triton_kernels
    from opencomposer.inference.kernels import gemv as triton_gemv
    from opencomposer.inference.kernels import moe as triton_moe
    from opencomposer.inference.kernels import prefill as triton_prefill
    from opencomposer.inference.kernels import sample as triton_sample

    return {"triton_gemv": triton_gemv, "triton_kernels": triton_kernels, "triton_prefill": triton_prefill,
            "triton_sample": triton_sample, "triton_moe": triton_moe}


def test_gemv_prologues_match_torch(interpreted):
    gemv = interpreted["triton_gemv"].gemv
    torch.manual_seed(0)
    k, n = 96, 70
    for m in (1, 3):
        x, r, w = torch.randn(m, k), torch.randn(m, k), torch.randn(n, k)
        b, nw = torch.randn(n), torch.randn(k)
        assert torch.allclose(gemv(x, w, b), F.linear(x, w, b), atol=1e-4)
        y, s = gemv(x, w, norm_weight=nw, residual=r, eps=1e-6)
        assert torch.equal(s, x + r)
        assert torch.allclose(y, F.linear(F.rms_norm(x + r, (k,), nw, 1e-6), w), atol=1e-4)
        y, s = gemv(x, w, norm_weight=nw, eps=1e-6)
        assert s is x and torch.allclose(y, F.linear(F.rms_norm(x, (k,), nw, 1e-6), w), atol=1e-4)
        gu = torch.randn(m, 2 * k)
        assert torch.allclose(gemv(gu, w, silu_mul=True), F.linear(F.silu(gu[:, :k]) * gu[:, k:], w), atol=1e-4)
    # no rows (the logits of a prefill chunk that samples nothing): empty results, no launch
    assert gemv(torch.randn(0, k), w).shape == (0, n)
    assert [t.shape for t in gemv(torch.randn(0, k), w, norm_weight=nw, residual=torch.randn(0, k))] == [(0, n), (0, k)]
    with pytest.raises(ValueError, match="at most"):
        gemv(torch.randn(9, k), w)
    with pytest.raises(ValueError, match="columns"):
        gemv(torch.randn(1, k + 1), w)


def _decode_logits(model, prompt, fused: bool, plan: dict | None):
    """Prefill ``prompt`` with the torch path, then one decode step with the chosen path."""
    from opencomposer.inference.models.attention import AttentionBatch

    cfg = model.cfg
    bs, nblocks = 16, 8
    shape = (cfg.num_layers, nblocks, bs, cfg.num_kv_heads, cfg.head_dim)
    kc, vc = torch.zeros(shape), torch.zeros(shape)
    table = [3, 5, 1]
    slots = [table[t // bs] * bs + t % bs for t in range(len(prompt) + 1)]
    model.use_triton(False)
    model.gemv_rows = 0
    n = len(prompt)
    pre = AttentionBatch(slot_mapping=torch.tensor(slots[:n]), decode=False, num_tokens=n,
                         fresh_index=torch.arange(n)[None], fresh_valid=torch.ones(1, n, dtype=torch.bool),
                         fresh_rows=torch.arange(n))
    hidden = model(torch.tensor(prompt), torch.arange(n), pre, kc, vc)
    token = int(model.logits(hidden[-1:]).argmax())
    model.use_triton(fused)
    model.gemv_rows, model.gemv_plan = (1, plan) if plan else (0, None)
    dec = AttentionBatch(slot_mapping=torch.tensor(slots[n:]), decode=True, block_tables=torch.tensor([table]),
                         context_lens=torch.tensor([n + 1]), num_tokens=1, triton_decode=fused, kv_written=fused)
    out = model.logits(model(torch.tensor([token]), torch.tensor([n]), dec, kc, vc))
    model.use_triton(False)
    model.gemv_rows, model.gemv_plan = 0, None
    return out


def test_fused_gemv_decode_step_matches_torch_path(interpreted, tiny_hf):
    from opencomposer.inference.models.transformer import from_hf_model

    model = from_hf_model(tiny_hf("qwen2"))
    prompt = list(range(5, 40))
    plan = interpreted["triton_gemv"].default_plan(model.cfg)
    mixed = {**plan, "qkv": None, "down": None}  # cuBLAS (torch here) for two of the projections
    with torch.inference_mode():
        ref = _decode_logits(model, prompt, fused=False, plan=None)
        fused = _decode_logits(model, prompt, fused=True, plan=None)
        small = _decode_logits(model, prompt, fused=True, plan=plan)
        part = _decode_logits(model, prompt, fused=True, plan=mixed)
    for got in (fused, small, part):
        assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_moe_kernels_match_the_general_path(interpreted):
    """Routing (with the route buffer) and the experts for a few tokens against ``moe.SparseMoE``'s
    torch path; a non-power-of-two expert count and top-k, and a token with tied scores."""
    from opencomposer.inference.models.moe import SparseMoE

    tm = interpreted["triton_moe"]
    torch.manual_seed(0)
    for experts, k, norm in ((8, 2, True), (12, 3, False)):
        moe = SparseMoE(48, 40, experts, k, norm)
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0, 0.2)
        x = torch.randn(5, 48)
        logits = torch.nn.functional.linear(x, moe.gate.weight)
        logits[4] = 0.0  # all tied: the kernel takes the lowest indices (torch.topk's pick among ties is its own)
        routes = torch.full((20, k), -1, dtype=torch.int16)
        slots = torch.tensor([3, 7, 11, 2, 19])
        idx, weights = tm.moe_route(logits, k, norm, torch.float32, routes, slots)
        probs = torch.softmax(logits, -1)
        want_w, want_i = torch.topk(probs, k, -1)
        if norm:
            want_w = want_w / want_w.sum(-1, keepdim=True)
        want_i[4] = torch.arange(k)
        assert torch.equal(idx.long(), want_i) and torch.allclose(weights, want_w, atol=1e-6)
        assert torch.equal(routes[slots].long(), want_i) and (routes[[0, 1, 4]] == -1).all()
        with torch.no_grad():
            got = tm.moe_experts(x, idx, weights, moe.experts.gate_up_proj, moe.experts.down_proj)
            ref = moe.experts(x, want_i, want_w)
        assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
        with torch.no_grad():  # the module's own switch, on its own logits
            plain = moe(x)
            moe.fused, moe.routes = True, torch.full((20, k), -1, dtype=torch.int16)
            assert torch.allclose(moe(x, slots), plain, atol=1e-5)
        assert torch.equal(moe.routes[slots[:4]].long(), want_i[:4])


def test_paged_prefill_matches_dense_causal_attention(interpreted):
    tp = interpreted["triton_prefill"]
    torch.manual_seed(1)
    h, kvh, d, bs, nblocks = 4, 2, 32, 16, 24
    kc, vc = torch.randn(nblocks, bs, kvh, d), torch.randn(nblocks, bs, kvh, d)
    perm = torch.randperm(nblocks).tolist()
    # (new tokens, context): fresh, long cached prefix, one token on a prefix, fresh of one, and a
    # short turn on a prefix of whole 64-key tiles that every row sees (the kernel's unmasked loop)
    shapes = [(5, 5), (37, 70), (1, 20), (1, 1), (9, 150)]
    tables = [perm[0:1], perm[1:6], perm[6:8], perm[8:9], perm[9:19]]
    total = sum(n for n, _ in shapes)
    q = torch.randn(total, h + 2 * kvh, d)[:, :h]  # a strided view, as the model passes it
    starts = [sum(n for n, _ in shapes[:i]) for i in range(len(shapes))]
    tp.warm_up(kc, h)  # the engine's start-up compile of every eager variant: a no-work step each
    # 2 padding tiles of a padding sequence, as a CUDA graph's step has; both 128-row tiles
    T = tp.Tile
    for tile, splits in ((T(16), 1), (T(32), 1), (T(16), 4), (T(64), 2), (tp.WIDE[0], 2), (tp.WIDE[1], 2),
                         (T(64), 16)):
        tiles, seqs = tp.plan(starts, [n for n, _ in shapes], [c for _, c in shapes], tile.rows, h // kvh)
        width = max(map(len, tables))
        padded = torch.tensor([tiles[0] + [len(shapes)] * 2, tiles[1] + [0] * 2])
        got = tp.paged_prefill(q, kc, vc, torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width]),
                               torch.tensor([row + [0] for row in seqs]), padded, tile, splits)
        for (n, c), table, s in zip(shapes, tables, starts):
            slots = torch.tensor([table[i // bs] * bs + i % bs for i in range(c)])
            k = kc.view(-1, kvh, d)[slots].transpose(0, 1).repeat_interleave(h // kvh, 0)
            v = vc.view(-1, kvh, d)[slots].transpose(0, 1).repeat_interleave(h // kvh, 0)
            mask = torch.arange(c)[None, :] <= (torch.arange(n)[:, None] + c - n)
            ref = F.scaled_dot_product_attention(q[s:s + n].transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)
            assert torch.allclose(got[s:s + n], ref, atol=1e-4), ((n, c), (got[s:s + n] - ref).abs().max())


def test_paged_decode_matches_torch_path(interpreted):
    from opencomposer.inference.models.attention import _decode, decode_mask

    torch.manual_seed(2)
    h, kvh, d, bs, nblocks, width = 4, 2, 32, 16, 40, 9
    kc, vc = torch.randn(nblocks, bs, kvh, d), torch.randn(nblocks, bs, kvh, d)
    tables = torch.randperm(nblocks)[: 4 * width].view(4, width)
    lens = torch.tensor([1, 17, 64, 144])
    q = torch.randn(4, h, d)
    ref = _decode(q, kc, vc, tables, decode_mask(tables, lens, bs, q.dtype))
    paged_decode = interpreted["triton_kernels"].paged_decode
    counters = torch.zeros(8, dtype=torch.int32)
    for b in (1, 4):  # one sequence: many splits; four: fewer (the last split to arrive merges)
        got = paged_decode(q[:b], kc, vc, tables[:b], lens[:b], counters)
        assert torch.allclose(got, ref[:b], atol=1e-4), (got - ref[:b]).abs().max()
        assert counters.eq(0).all(), counters  # left zero for the next layer / step
    # 128 sequences x 2 KV heads: one split each (the program writes the output itself), so a
    # program walks all three key tiles (the first loaded before the PDL wait, the rest in the loop)
    many = torch.arange(128) % 4
    got = paged_decode(q[many], kc, vc, tables[many], lens[many])
    assert torch.allclose(got, ref[many], atol=1e-4), (got - ref[many]).abs().max()
    with pytest.raises(ValueError, match="counters must be int32 with >= 8 entries"):
        paged_decode(q[:4], kc, vc, tables[:4], lens[:4], torch.zeros(4, dtype=torch.int32))



def test_fused_sampling_matches_softmax(interpreted):
    """Two-kernel sampler: greedy rows take the argmax, drawn rows follow softmax(logits / T),
    logprobs are log_softmax(logits / T)[token], and the device seed advances per call."""
    sample_plain_fused = interpreted["triton_sample"].sample_plain_fused
    torch.manual_seed(3)
    v, rows = 37, 150
    logits = (torch.randn(1, v) * 2).expand(rows, v).contiguous()
    temps = torch.full((rows,), 0.7)
    greedy = torch.zeros(rows)
    greedy[:3] = 1.0
    inputs = torch.stack([temps, greedy])
    seed = torch.tensor([123])
    out = sample_plain_fused(logits, inputs, seed)
    assert seed.item() == 124
    tokens = out[0].long()
    ref = torch.log_softmax(logits[0] / 0.7, -1)
    assert (tokens[:3] == logits[0].argmax()).all()
    assert torch.allclose(out[1].float(), ref[tokens], atol=1e-5)
    freq = torch.bincount(tokens[3:], minlength=v).float() / (rows - 3)
    assert (freq - ref.exp()).abs().max() < 0.12, (freq, ref.exp())  # 147 draws, fixed seed
    again = sample_plain_fused(logits, inputs, seed)
    assert not torch.equal(again[0], out[0])  # a new seed: new draws


def test_fused_mtp_head_matches_the_module(interpreted):
    """``speculate.fused_head`` (rmsnorm / silu_mul / add_rmsnorm kernels) against ``MTPHead.forward``."""
    from opencomposer.inference.engine.speculate import fused_head
    from opencomposer.models.mtp import MTPConfig, MTPHead

    torch.manual_seed(0)
    head = MTPHead(MTPConfig(hidden_size=64, vocab_size=97))
    torch.nn.init.normal_(head.down.weight, std=0.1)
    for norm in (head.norm_h, head.norm_e, head.norm_m, head.norm_out):
        torch.nn.init.normal_(norm.weight, mean=1.0, std=0.2)
    h, e = torch.randn(3, 64), torch.randn(3, 64)
    with torch.no_grad():
        want = head(h, e)
        got = fused_head(head, h, e)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
