"""The engine against Hugging Face on the same weights (fp32, CPU): greedy tokens equal to
``generate``, logprobs equal to the trainer's forward pass, for Llama, Qwen2 and Qwen3."""

from __future__ import annotations

import torch

from opencomposer.inference.engine.core import Engine, SamplingParams


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _trainer_logprobs(hf, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)  # as train/loss.py computes it
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0]


def test_greedy_matches_hf_generate(family, tiny_hf, prompts):
    hf = tiny_hf(family)
    engine = Engine(hf, None, max_num_seqs=4, max_model_len=128, block_size=4)
    ps = prompts(5)
    outs = engine.generate(ps, SamplingParams(max_tokens=24, temperature=0))
    distinct = set()
    for p, c in zip(ps, outs):
        assert c.token_ids == _hf_greedy(hf, p, 24), family
        assert c.finish_reason == "length"
        distinct.update(c.token_ids)
    assert len(distinct) > 5  # the model is not degenerate, so the comparison means something
    assert engine.stats()["kv_blocks_used"] == 0


def test_logprob_parity_fp32(family, tiny_hf, prompts):
    hf = tiny_hf(family, tie=family != "llama")
    engine = Engine(hf, None, max_num_seqs=8, max_model_len=128, block_size=8)
    ps = prompts(6, seed=2)
    diffs = []
    for temperature in (1.0, 0.7):
        outs = engine.generate(ps, SamplingParams(max_tokens=16, temperature=temperature, seed=3))
        for p, c in zip(ps, outs):
            ref = _trainer_logprobs(hf, p, c.token_ids, temperature)
            diffs.append((ref - torch.tensor(c.logprobs)).abs())
    d = torch.cat(diffs)
    assert d.mean().item() <= 1e-3 and d.max().item() <= 1e-2, (d.mean().item(), d.max().item())


def test_chunked_prefill_and_block_size_do_not_change_outputs(tiny_hf, prompts):
    hf = tiny_hf("qwen3")
    ps = prompts(4, lo=30, hi=60, seed=4)
    params = SamplingParams(max_tokens=12, temperature=0)
    ref = [c.token_ids for c in Engine(hf, None, max_model_len=128).generate(ps, params)]
    small = Engine(hf, None, max_model_len=128, block_size=2, max_num_batched_tokens=7)
    assert [c.token_ids for c in small.generate(ps, params)] == ref
    assert small.stats()["kv_blocks_used"] == 0


def test_llama3_rope_scaling_matches_hf():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.25,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    p = list(range(3, 90))  # long enough that the scaled low frequencies matter
    c = Engine(hf, None, max_model_len=128).generate([p], SamplingParams(max_tokens=8, temperature=0))[0]
    assert c.token_ids == _hf_greedy(hf, p, 8)
    ref = _trainer_logprobs(hf, p, c.token_ids, 1.0)
    assert (ref - torch.tensor(c.logprobs)).abs().max().item() < 1e-4


def test_first_layers_runs_only_those_layers_and_ends_with_the_block(tiny_hf, prompts):
    import copy

    hf = tiny_hf("qwen3")
    one = copy.deepcopy(hf)
    one.model.layers = one.model.layers[:1]
    one.config.num_hidden_layers = 1
    ps, params = prompts(3, seed=5), SamplingParams(max_tokens=10, temperature=0)
    engine = Engine(hf, None, max_model_len=128)
    full = [c.token_ids for c in engine.generate(ps, params)]
    with engine.model.first_layers(1):  # start-up's compile-only pass runs the model like this
        first = [c.token_ids for c in engine.generate(ps, params)]
    assert first == [c.token_ids for c in Engine(one, None, max_model_len=128).generate(ps, params)]
    assert first != full  # the second layer matters, so the equality above means something
    assert [c.token_ids for c in engine.generate(ps, params)] == full


def test_linear_few_rows_on_the_cpu_are_nn_linear():
    """``Linear`` computes a few rows as W @ x^T on the CPU (a faster BLAS path there): the
    same parameters, names and numbers as ``nn.Linear`` up to summation order."""
    from opencomposer.inference.models.transformer import FEW_ROWS, Linear

    torch.manual_seed(0)
    for bias in (False, True):
        ref = torch.nn.Linear(96, 200, bias=bias)
        lin = Linear(96, 200, bias=bias)
        lin.load_state_dict(ref.state_dict())
        assert list(lin.state_dict()) == list(ref.state_dict())
        for rows in (1, 3, FEW_ROWS, FEW_ROWS + 1, 300):
            x = torch.randn(rows, 96)
            out = lin(x)
            assert out.shape == (rows, 200) and out.is_contiguous()
            torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(3, 96, dtype=torch.float64)  # other dtypes take F.linear
        torch.testing.assert_close(lin.double()(x), ref.double()(x))


def test_greedy_matches_hf_on_a_context_extended_by_yarn(family, tiny_hf, prompts):
    """A model whose context was extended 4x (``train/long_context.py``): the engine reads the
    YaRN scaling from the config, and its greedy tokens equal HF's on prompts past the native 512."""
    from opencomposer.train.long_context import extend_context

    hf = tiny_hf(family)
    extend_context(hf, 4.0)
    assert hf.config.max_position_embeddings == 2048
    engine = Engine(hf, None, max_num_seqs=2, max_model_len=2048, block_size=16)
    ps = prompts(2, lo=600, hi=900, seed=7)
    outs = engine.generate(ps, SamplingParams(max_tokens=12, temperature=0))
    for p, c in zip(ps, outs):
        assert c.token_ids == _hf_greedy(hf, p, 12), family
