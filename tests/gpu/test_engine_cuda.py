"""The engine on CUDA: CUDA-graph decode equals eager decode and HF greedy (fp32), weight
updates stay visible to captured graphs, and bf16 logprobs stay close to HF's.

Run on a GPU box: ``PYTHONPATH=src python -m pytest -q tests/gpu/test_engine_cuda.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from opencomposer.inference.engine.core import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _tiny(seed: int = 0, dtype=torch.float32, hidden: int = 128, intermediate: int = 256, positions: int = 1024):
    """A 2-layer Qwen2 (4 query heads, 2 KV heads: head_dim ``hidden`` / 4) on the GPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=1000, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                      tie_word_embeddings=True, initializer_range=0.1)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).to(device="cuda", dtype=dtype).eval()


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (int(k),), generator=g).tolist() for k in torch.randint(5, 60, (n,), generator=g)]


def _hf_greedy(hf, p, n):
    ids = torch.tensor([p], device="cuda")
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(p):].tolist()


def test_triton_paged_decode_matches_torch_path():
    from opencomposer.inference.models.attention import _decode, decode_mask
    from opencomposer.inference.kernels.fused import paged_decode

    torch.manual_seed(0)
    for dtype, h, kvh, d in ((torch.float32, 14, 2, 64), (torch.bfloat16, 12, 2, 128), (torch.bfloat16, 16, 8, 64)):
        n_blocks, bs, b, width = 64, 16, 5, 9
        k_cache = torch.randn(n_blocks, bs, kvh, d, device="cuda", dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(n_blocks, device="cuda")[: b * width].view(b, width)
        lens = torch.tensor([1, 17, 50, 144, 100], device="cuda")
        q = torch.randn(b, h, d, device="cuda", dtype=dtype)
        ref = _decode(q, k_cache, v_cache, tables, decode_mask(tables, lens, bs, dtype))
        got = paged_decode(q, k_cache, v_cache, tables, lens)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert (got.float() - ref.float()).abs().max().item() < tol, (dtype, h, kvh, d)


def test_decode_split_merge_has_no_race_and_leaves_its_counters_zero():
    """The last key split to arrive merges them (an atomic counter): a race would make
    identical calls differ, or leave a counter set for the next layer."""
    from opencomposer.inference.models.attention import _decode, decode_mask
    from opencomposer.inference.kernels.fused import paged_decode, pdl_launches

    torch.manual_seed(0)
    h, kvh, d, bs, n_blocks, width = 12, 2, 128, 16, 4096, 64
    k_cache = torch.randn(n_blocks, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    for pdl in (False, True):
        for b in (1, 3, 64, 200):  # 32 splits down to 1
            tables = torch.randint(0, n_blocks, (b, width), device="cuda")
            lens = torch.randint(1, width * bs + 1, (b,), device="cuda")
            q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
            counters = torch.zeros(b * kvh, dtype=torch.int32, device="cuda")
            with pdl_launches() if pdl else contextlib.nullcontext():
                outs = [paged_decode(q, k_cache, v_cache, tables, lens, counters) for _ in range(200)]
            ref = _decode(q, k_cache, v_cache, tables, decode_mask(tables, lens, bs, q.dtype)).float()
            assert sum(not torch.equal(o, outs[0]) for o in outs) == 0, (pdl, b)
            assert counters.eq(0).all(), (pdl, b)
            assert (outs[0].float() - ref).abs().max().item() < 2e-2, (pdl, b)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_graph_decode_matches_eager_and_hf(kernels):
    hf = _tiny()
    ps = _prompts(12)
    params = SamplingParams(max_tokens=20, temperature=0)
    graphs = Engine(hf, None, max_num_seqs=16, max_model_len=128, kernels=kernels)
    eager = Engine(hf, None, max_num_seqs=16, max_model_len=128, cuda_graphs=False, kernels="torch")
    assert graphs.stats()["cuda_graph_batch_sizes"] == [1, 2, 4, 8, 16]
    assert graphs.stats()["kernels"] == kernels
    # start-up is accounted: seconds by part, and the memory the graphs hold
    parts = ["decode_graphs"] + (["warm_up", "prefill_graphs"] if kernels == "triton" else [])
    assert list(graphs.stats()["graph_capture_s"]) == parts
    assert graphs.stats()["graph_memory_bytes"] > 0
    assert eager.stats()["graph_capture_s"] == {} and eager.stats()["graph_memory_bytes"] == 0
    a = [c.token_ids for c in graphs.generate(ps, params)]
    b = [c.token_ids for c in eager.generate(ps, params)]
    assert a == b
    assert a[:4] == [_hf_greedy(hf, p, 20) for p in ps[:4]]
    assert graphs.stats()["kv_blocks_used"] == eager.stats()["kv_blocks_used"] == 0


def test_weight_update_reaches_captured_graphs():
    hf, other = _tiny(0), _tiny(1)
    engine = Engine(hf, None, max_num_seqs=4, max_model_len=128)
    p = _prompts(1, seed=3)[0]
    engine.generate([p], SamplingParams(max_tokens=8, temperature=0))
    engine.update_weights(other.state_dict(), version=7)
    c = engine.generate([p], SamplingParams(max_tokens=8, temperature=0))[0]
    assert c.token_ids == _hf_greedy(other, p, 8)
    assert c.policy_versions == [7] * 8 and c.cached_prompt_tokens == 0


def test_bf16_logprobs_close_to_hf():
    hf = _tiny(dtype=torch.bfloat16)
    engine = Engine(hf, None, max_num_seqs=8, max_model_len=128)
    ps = _prompts(8, seed=4)
    outs = engine.generate(ps, SamplingParams(max_tokens=16, temperature=1.0, seed=0))
    diffs = []
    with torch.inference_mode():
        for p, c in zip(ps, outs):
            logits = hf(torch.tensor([p + c.token_ids], device="cuda")).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0]
            diffs.append((ref.cpu() - torch.tensor(c.logprobs)).abs())
    d = torch.cat(diffs)
    assert d.mean().item() < 0.05, d.mean().item()


def test_fused_kernels_match_torch_ops():
    from opencomposer.inference.kernels import fused as tk
    from opencomposer.inference.models.transformer import RMSNorm

    torch.manual_seed(0)
    x, r = torch.randn(7, 896, device="cuda"), torch.randn(7, 896, device="cuda")
    norm = RMSNorm(896, 1e-6).cuda()
    torch.nn.init.normal_(norm.weight)
    r2 = r.clone()
    got = tk.add_rmsnorm(x, r2, norm.weight, 1e-6)
    assert torch.allclose(r2, x + r) and torch.allclose(got, norm(x + r), atol=1e-5)
    gu = torch.randn(5, 2 * 300, device="cuda")
    want = torch.nn.functional.silu(gu[:, :300]) * gu[:, 300:]
    assert torch.allclose(tk.silu_mul(gu), want, atol=1e-5)
    nh, nkv, d, t = 6, 2, 64, 5
    qkv = torch.randn(t, (nh + 2 * nkv) * d, device="cuda")
    pos = torch.tensor([0, 3, 7, 100, 2000], device="cuda")
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = pos.float()[:, None] * inv[None]
    kc, vc = torch.zeros(4, 16, nkv, d, device="cuda"), torch.zeros(4, 16, nkv, d, device="cuda")
    slots = torch.tensor([0, 17, 18, 40, 63], device="cuda")
    ref = qkv.clone().view(t, nh + 2 * nkv, d)
    emb = torch.cat((freqs, freqs), -1)[:, None]
    half = d // 2
    rot = torch.cat((-ref[..., half:], ref[..., :half]), -1)
    want_qk = (ref * emb.cos() + rot * emb.sin())[:, :nh + nkv]
    tk.rope_and_cache(qkv, freqs.cos(), freqs.sin(), slots, kc, vc, nh, nkv)
    got3 = qkv.view(t, nh + 2 * nkv, d)
    assert torch.allclose(got3[:, :nh + nkv], want_qk, atol=1e-5)
    assert torch.allclose(kc.view(-1, nkv, d)[slots], want_qk[:, nh:], atol=1e-5)
    assert torch.allclose(vc.view(-1, nkv, d)[slots], ref[:, nh + nkv:])


def test_parallel_compile_compiles_without_running_then_launches_run():
    """Start-up's parallel compile: inside, a launch only queues its compile (the in-place
    residual add of ``add_rmsnorm`` does not happen); after it, the same launch runs."""
    from opencomposer.inference.kernels import fused as tk
    x = torch.randn(4, 320, device="cuda")
    r, w = torch.zeros_like(x), torch.ones(320, device="cuda")
    with tk.parallel_compile(torch.device("cuda"), threads=4):
        assert tk._COMPILE_ONLY[0]
        tk.add_rmsnorm(x, r, w, 1e-6)
    assert not tk._COMPILE_ONLY[0]
    torch.cuda.synchronize()
    assert torch.count_nonzero(r) == 0
    out = tk.add_rmsnorm(x, r, w, 1e-6)
    assert torch.equal(r, x)
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6))


def test_gemv_batch1_graph_matches_cublas_graph():
    """Batch-1 decode through the fused GEMV graph gives HF's greedy tokens (fp32), and its
    in-graph sampled logprobs match the cuBLAS graph's."""
    hf = _tiny()
    p = _prompts(1, seed=5)[0]
    gemv = Engine(hf, None, max_num_seqs=4, max_model_len=128, gemv=True)
    cublas = Engine(hf, None, max_num_seqs=4, max_model_len=128, gemv=False)
    assert gemv.stats()["gemv_batch1"] and not cublas.stats()["gemv_batch1"]
    a = gemv.generate([p], SamplingParams(max_tokens=20, temperature=0))[0]
    b = cublas.generate([p], SamplingParams(max_tokens=20, temperature=0))[0]
    assert a.token_ids == b.token_ids == _hf_greedy(hf, p, 20)
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    auto = Engine(hf, None, max_num_seqs=4, max_model_len=128)
    ms = auto.stats()["capture_b1_ms"]  # every batch-1 graph timed at start-up; the fastest is kept
    assert {"cublas", "gemv"} <= set(ms), ms
    assert auto.stats()["gemv_batch1"] == (ms["cublas"] > min(ms.values())), ms


def test_gemv_kernel_bf16_on_model_shapes():
    from opencomposer.inference.kernels.gemv import gemv

    torch.manual_seed(0)
    for n, k in ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)):
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        ref = torch.nn.functional.linear(x.float(), w.float())
        assert (gemv(x, w).float() - ref).abs().max().item() < 2e-2 * max(1.0, ref.abs().max().item())


def test_triton_prefill_with_cached_prefix_matches_torch():
    """A second turn that extends the first (prefix cache hit) gives the same greedy tokens
    and logprobs through the Triton paged prefill (a prefill CUDA graph: one sequence of
    < 512 tokens) as through the torch path; and a 600-token prompt (eager Triton prefill)."""
    hf = _tiny()
    p = _prompts(1, seed=6)[0] * 3
    outs = {}
    for kernels in ("triton", "torch"):
        engine = Engine(hf, None, max_num_seqs=4, max_model_len=1024, kernels=kernels)
        assert bool(engine.stats()["prefill_graph_tokens"]) == (kernels == "triton")
        first = engine.generate([p], SamplingParams(max_tokens=8, temperature=0))[0]
        second = engine.generate([p + first.token_ids + p[:20]], SamplingParams(max_tokens=8, temperature=0))[0]
        assert second.cached_prompt_tokens >= 16
        long = engine.generate([(p * 40)[:600]], SamplingParams(max_tokens=4, temperature=0))[0]
        outs[kernels] = (first, second, long)
    for a, b in zip(outs["triton"], outs["torch"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


class _Counted:
    """A captured graph whose replays are counted."""

    def __init__(self, graph, calls: list):
        self.graph, self.calls = graph, calls

    def replay(self):
        self.calls.append(1)
        self.graph.replay()


def test_a_turn_on_a_long_history_splits_its_keys_inside_the_prefill_graph():
    """A 20,000-token history, then a turn of ~40 new tokens on it: the turn replays its
    bucket's graph with the most key splits (16: this tiny model's short turns take 16 on
    any history), and its greedy tokens and logprobs are the torch path's."""
    hf = _tiny(positions=32768)
    history = torch.randint(0, 1000, (20_000,), generator=torch.Generator().manual_seed(11)).tolist()
    outs = {}
    for kernels in ("triton", "torch"):
        engine = Engine(hf, None, max_num_seqs=4, max_model_len=24_576, kernels=kernels)
        first = engine.generate([history], SamplingParams(max_tokens=4, temperature=0))[0]
        replays = []
        if kernels == "triton":
            graphs = engine.runner.prefill_graphs[engine.runner.prefill_bucket(44)]
            most = max(graphs, key=lambda v: v[1])  # (tile, splits)
            assert most[1] == 16, graphs
            graphs[most] = _Counted(graphs[most], replays)
        second = engine.generate([history + first.token_ids + list(range(100, 140))],
                                 SamplingParams(max_tokens=6, temperature=0))[0]
        assert second.cached_prompt_tokens >= 19_984
        assert len(replays) == (kernels == "triton")  # the turn's step took the 16-split graph
        outs[kernels] = (first, second)
        assert engine.stats()["kv_blocks_used"] == 0
    for a, b in zip(outs["triton"], outs["torch"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_long_prompts_take_128_row_tiles_that_match_sdpa():
    """A fresh 8,192-token prompt of a head_dim-128 model (bf16) takes 128-row tiles; they (both
    kinds: long steps', long histories') and the 64-row tiles give SDPA's causal attention
    (fp32 reference) to bf16 precision."""
    import torch.nn.functional as F

    from opencomposer.inference.kernels.prefill import (
        WIDE,
        Tile,
        paged_prefill,
        plan,
        tile_for,
    )

    h, kvh, d, bs, n = 12, 2, 128, 16, 8192
    assert tile_for(n, h // kvh, d, 2, n) == WIDE[1] and tile_for(n, h // kvh, d, 4, n).rows == 64
    torch.manual_seed(3)
    kc = torch.randn(n // bs + 1, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(n // bs, device="cuda")[None]
    q = torch.randn(n, h + 2 * kvh, d, device="cuda", dtype=torch.bfloat16)[:, :h]
    k = kc[table[0]].reshape(n, kvh, d).transpose(0, 1).repeat_interleave(h // kvh, 0).float()
    v = vc[table[0]].reshape(n, kvh, d).transpose(0, 1).repeat_interleave(h // kvh, 0).float()
    ref = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k, v, is_causal=True).transpose(0, 1)
    for tile in (*WIDE, Tile(64)):
        tiles, seqs = plan([0], [n], [n], tile.rows, h // kvh)
        got = paged_prefill(q, kc, vc, table, torch.tensor(seqs, device="cuda"), torch.tensor(tiles, device="cuda"),
                            tile)
        assert (got.float() - ref).abs().max() < 2e-2, tile


def test_a_group_of_turns_on_long_histories_replays_a_128_row_graph():
    """Two turns of 1,100 new tokens on 16,400-token histories in one step (bf16, head_dim
    128): 4,608 (token, head) rows on > 16,000 keys, so the step replays its bucket's graph
    with 128-row tiles (``tile_for``). Its greedy tokens are those of each turn alone (64-row
    tiles: 2,204 rows) and of the torch path, and its logprobs are as close to the torch
    path's as the 64-row path's are (bf16 rounding, not the tile, sets the difference)."""
    from opencomposer.inference.kernels.prefill import WIDE

    hf = _tiny(dtype=torch.bfloat16, hidden=512, intermediate=512, positions=32768)
    g = torch.Generator().manual_seed(12)
    histories = [torch.randint(0, 1000, (16_400,), generator=g).tolist() for _ in range(2)]
    turns = [torch.randint(0, 1000, (1_100,), generator=g).tolist() for _ in range(2)]
    outs = {}
    for name, kernels in (("wide", "triton"), ("narrow", "triton"), ("torch", "torch")):
        engine = Engine(hf, None, max_num_seqs=4, max_model_len=20_480, dtype=torch.bfloat16, kernels=kernels)
        first = engine.generate(histories, SamplingParams(max_tokens=2, temperature=0))
        replays = []
        if kernels == "triton":
            graphs = engine.runner.prefill_graphs[engine.runner.prefill_bucket(2 * 1_102, 2)]
            wide = [v for v in graphs if v[0] == WIDE[0]]
            assert len(wide) == 1, graphs
            graphs[wide[0]] = _Counted(graphs[wide[0]], replays)
        prompts = [h + c.token_ids + t for h, c, t in zip(histories, first, turns)]
        greedy = SamplingParams(max_tokens=3, temperature=0)
        second = ([engine.generate([p], greedy)[0] for p in prompts] if name == "narrow"
                  else engine.generate(prompts, greedy))
        assert [c.cached_prompt_tokens for c in second] == [16_400, 16_400]
        assert len(replays) == (name == "wide")  # only the group's step took the 128-row graph
        outs[name] = second
        assert engine.stats()["kv_blocks_used"] == 0
    diff = {}
    for name in ("wide", "narrow"):
        for a, b in zip(outs[name], outs["torch"]):
            assert a.token_ids == b.token_ids, name
        diff[name] = max(abs(x - y) for a, b in zip(outs[name], outs["torch"]) for x, y in zip(a.logprobs, b.logprobs))
    print("max |logprob - torch path's|:", diff)
    assert diff["wide"] <= 1.5 * diff["narrow"] + 1e-2, diff


def test_group_sharing_a_prompt_in_one_prefill_step_matches_each_alone():
    """Samples of one prompt submitted together reuse its blocks within the step (the Triton
    prefill graph reads K/V other rows of the same step wrote): same tokens and logprobs as
    each prompt alone, for two prompt lengths (two prefill graph buckets)."""
    hf = _tiny()
    base = _prompts(1, seed=8)[0] * 60
    for shared in (base[:200], base[:600]):
        group = [shared, shared + [3, 4, 5], shared, shared[:33] + [9] * 12]
        engine = Engine(hf, None, max_num_seqs=4, max_model_len=1024)
        outs = engine.generate(group, SamplingParams(max_tokens=6, temperature=0))
        full = (len(shared) - 1) // 16 * 16
        assert [c.cached_prompt_tokens for c in outs] == [0, (len(shared) + 2) // 16 * 16, full, 32]
        for p, c in zip(group, outs):
            alone = Engine(hf, None, max_num_seqs=4, max_model_len=1024).generate(
                [p], SamplingParams(max_tokens=6, temperature=0))[0]
            assert c.token_ids == alone.token_ids
            assert max(abs(x - y) for x, y in zip(c.logprobs, alone.logprobs)) < 1e-4
        assert engine.stats()["kv_blocks_used"] == 0


def test_in_graph_sampling_logprobs_match_hf_fp32():
    """Unseeded temperature sampling runs inside the decode graph; its logprobs are HF's."""
    hf = _tiny()
    engine = Engine(hf, None, max_num_seqs=8, max_model_len=128)
    ps = _prompts(4, seed=8)
    outs = engine.generate(ps, SamplingParams(max_tokens=12, temperature=0.8))
    with torch.inference_mode():
        for p, c in zip(ps, outs):
            logits = hf(torch.tensor([p + c.token_ids], device="cuda")).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits / 0.8, -1).gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0]
            assert (ref.cpu() - torch.tensor(c.logprobs)).abs().max().item() < 1e-4


def test_fused_sampler_on_a_real_vocabulary():
    """The two-kernel sampler on [256, 151936] bf16 logits: greedy rows give the argmax,
    logprobs equal log_softmax(logits / T)[token], and draws follow the distribution."""
    from opencomposer.inference.engine.sampler import sample_plain
    from opencomposer.inference.kernels.sample import sample_plain_fused

    torch.manual_seed(0)
    b, v = 256, 151936
    logits = (torch.randn(b, v, device="cuda") * 3).to(torch.bfloat16)
    logits[:, :4] += 12.0  # most mass on 4 tokens, so draws can be counted
    temps = torch.full((b,), 0.9, device="cuda")
    greedy = torch.zeros(b, device="cuda")
    greedy[:8] = 1.0
    inputs = torch.stack([temps, greedy])
    seed = torch.tensor([7], device="cuda")
    counts = torch.zeros(v, device="cuda")
    for _ in range(8):
        out = sample_plain_fused(logits, inputs, seed)
        tok = out[0].long()
        ref = torch.log_softmax(logits.float() / 0.9, -1)
        assert torch.equal(tok[:8], logits[:8].float().argmax(-1))
        assert (out[1] - ref.gather(1, tok[:, None])[:, 0].double()).abs().max().item() < 1e-4
        counts += torch.bincount(tok[8:], minlength=v).float()
    assert seed.item() == 15
    # rows differ, so compare the pooled frequency with the mean probability over drawn rows
    p = torch.softmax(logits[8:].float() / 0.9, -1).mean(0)
    freq = counts / counts.sum()
    assert (freq[:4] - p[:4]).abs().max().item() < 0.03, (freq[:4], p[:4])
    torch_out = sample_plain(logits, inputs)  # same contract as the torch sampler
    assert torch.equal(torch_out[0][:8], out[0][:8])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs compute capability 9.0+")
def test_pdl_changes_launch_order_only():
    """Programmatic dependent launch lets each Triton kernel start while the previous one
    drains; every kernel waits before reading its predecessor's output, so greedy tokens and
    logprobs are bit-identical with it on and off (graphs at batch 1 and 3, prefill graphs,
    eager prefill of a long prompt)."""
    hf = _tiny(dtype=torch.bfloat16)
    ps = _prompts(3, seed=4) + [list(range(1, 700))]  # the last one is prefilled eagerly (> 512 tokens)
    runs = {}
    for pdl in (False, True):
        # gemv=True: the same batch-1 projection configs in both (the timed choice could differ
        # between the two engines, and with it the order of the bf16 sums)
        engine = Engine(hf, None, max_num_seqs=4, max_model_len=1024, device="cuda", dtype=torch.bfloat16, pdl=pdl,
                        gemv=True)
        assert engine.stats()["pdl"] is pdl
        one = engine.generate(ps[:1], SamplingParams(max_tokens=24, temperature=0))
        many = engine.generate(ps, SamplingParams(max_tokens=24, temperature=0))
        runs[pdl] = [(c.token_ids, c.logprobs) for c in one + many]
        assert engine.stats()["kv_blocks_used"] == 0
    assert runs[True] == runs[False]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_run_ahead_decode_gives_the_same_outputs(kernels):
    """Run-ahead (step N+1 launched from step N's on-device tokens before they are read)
    moves host work off the GPU's critical path and changes nothing else: the same tokens,
    logprobs, finish reasons and policy versions as without it, with real CUDA graphs --
    sequences of different lengths, one stopped by a stop token mid-batch, a weight update
    between steps, and temperature sampling of one sequence (same noise, same order)."""
    hf, other = _tiny(0), _tiny(1)
    ps = _prompts(5, seed=6)
    runs, stats = {}, {}
    for ra in (False, True):
        torch.manual_seed(0)  # the fused sampler's device seed is drawn at construction
        # gemv=True: both engines use the same batch-1 projections (the timed choice may differ
        # between two engines, and with it the last bits of the logits)
        engine = Engine(hf, None, max_num_seqs=8, max_model_len=256, kernels=kernels, run_ahead=ra, gemv=True)
        # first, while both engines' sampler states are equal (a discarded step advances them)
        outs = engine.generate(ps[:1], SamplingParams(max_tokens=40, temperature=1.0))
        free = engine.generate(ps, SamplingParams(max_tokens=30, temperature=0))
        params = [SamplingParams(max_tokens=k, temperature=0) for k in (1, 7, 30, 30, 19)]
        params[3] = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(free[3].token_ids[9],))
        outs += engine.generate(ps, params)
        rids = [engine.add_request(p, SamplingParams(max_tokens=20, temperature=0)) for p in ps[:3]]
        for _ in range(6):
            engine.step()
        engine.update_weights(other.state_dict(), version=1)
        while engine.has_unfinished():
            engine.step()
        outs += [engine.completion(r) for r in rids]
        runs[ra] = [(c.token_ids, c.finish_reason, c.policy_versions) for c in outs]
        runs[ra, "lp"] = torch.tensor([lp for c in outs for lp in c.logprobs])
        stats[ra] = engine.stats()
        assert stats[ra]["kv_blocks_used"] == 0
    assert runs[True] == runs[False]
    assert (runs[True, "lp"] - runs[False, "lp"]).abs().max().item() < 1e-4
    assert runs[True][4][1] == "stop" and runs[True][6][2] == [0] * 6 + [1] * 14
    assert stats[True]["run_ahead"] and stats[True]["run_ahead_steps"] > 50
    assert stats[True]["run_ahead_discarded_rows"] >= 1 + 3  # the stopped row, the update's in-flight step
    assert stats[True]["generated_tokens"] == stats[False]["generated_tokens"]


OOM_SCRIPT = r"""
import gc, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from opencomposer.inference.engine.core import Engine, SamplingParams
# 16 layers: the cache the engine wants (2 x 256 sequences x 32,768 tokens, 275 GB) exceeds any
# one GPU's memory, so it takes all that is free (with 8 layers it wanted 137 GB: an H200 had room)
cfg = Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=16,
                  num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=32768, tie_word_embeddings=True)
hf = Qwen2ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
try:  # the KV cache takes all free memory: the graphs captured after it cannot fit
    Engine(hf, None, max_num_seqs=256, max_model_len=32768, device="cuda", dtype=torch.bfloat16, kv_memory_fraction=1.0)
    print("NO ERROR")
except ValueError as e:
    print("ERROR:", e)
gc.collect()
torch.cuda.empty_cache()
engine = Engine(hf, None, max_num_seqs=8, max_model_len=512, device="cuda", dtype=torch.bfloat16)
out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
print("RECOVERED", len(out[0].token_ids), engine.stats()["kv_blocks_used"])
"""


def test_out_of_memory_at_start_up_is_a_clear_error_and_recoverable():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", OOM_SCRIPT], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = next(line for line in proc.stdout.splitlines() if line.startswith(("ERROR", "NO ERROR")))
    assert err.startswith("ERROR: out of GPU memory building the engine") and "kv_memory_fraction=1.0" in err, err
    assert "RECOVERED 4 0" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_an_engine_on_the_second_gpu_captures_and_decodes_there_with_cuda0_current(kernels):
    # issue 33's layout: the trainer's thread has cuda:0 current, the engine lives on cuda:1
    # (session 29: its graph capture failed with "operation not permitted when stream is capturing")
    hf = _tiny()
    ps = _prompts(6)
    params = SamplingParams(max_tokens=16, temperature=0)
    here = [c.token_ids for c in Engine(hf, None, max_num_seqs=8, max_model_len=128, kernels=kernels).generate(ps, params)]
    torch.cuda.set_device(0)
    there = Engine(hf, None, max_num_seqs=8, max_model_len=128, kernels=kernels, device="cuda:1")
    assert there.device == torch.device("cuda:1") and there.stats()["cuda_graph_batch_sizes"]
    assert [c.token_ids for c in there.generate(ps, params)] == here
    other = _tiny(1)
    there.update_weights(other.state_dict(), version=3)  # the weight path from a cuda:0 trainer
    assert there.generate([ps[0]], params)[0].token_ids == _hf_greedy(other, ps[0], 16)
    assert torch.cuda.current_device() == 0
