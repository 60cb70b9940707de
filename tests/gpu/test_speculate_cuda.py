"""Speculative decoding on CUDA (Triton kernels, prefill graphs holding the verify steps): the
same greedy tokens as plain graph decoding in fp32, through both the graph and the eager
verify path, and the model's logprobs when sampling in bf16.

Run on a GPU box: ``PYTHONPATH=src python -m pytest -q tests/gpu/test_speculate_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

from opencomposer.inference.engine.core import Engine, SamplingParams
from opencomposer.inference.engine.speculate import Speculator
from opencomposer.train.mtp import head_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _tiny(dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, initializer_range=0.1)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(device="cuda", dtype=dtype).eval()


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (int(k),), generator=g).tolist() for k in torch.randint(5, 60, (n,), generator=g)]


class _Oracle(Speculator):
    """Drafts plain decoding's own next tokens, one in three spoiled (a test double for the head)."""

    answers: dict | None = None  # set per test

    def _store(self, seqs, drafts, q, new):
        for s, n in zip(seqs, new):
            truth = self.answers[tuple(s.token_ids[:s.num_prompt])]
            done = len(s.completion_ids) + len(n)
            d = truth[done:done + self.k]
            if (done // self.k) % 3 == 2 and d:
                d = d[:-1] + [(d[-1] + 1) % 1000]
            s.draft, s.draft_q = d, None


@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_speculation_equals_plain_graph_decoding(graphs):
    hf = _tiny()
    ps = _prompts(6)
    params = SamplingParams(max_tokens=40, temperature=0)
    plain = Engine(hf, None, max_model_len=256).generate(ps, params)
    head = head_for(hf).cuda()
    engine = Engine(hf, None, max_model_len=256, draft=head, num_draft=4, cuda_graphs=graphs,
                    spec_max_batch=8)
    oracle = _Oracle(engine.model, engine.speculator.head, 4, max_batch=8)
    oracle.answers = {tuple(p): c.token_ids for p, c in zip(ps, plain)}
    oracle.attach(engine.runner)
    engine.speculator = oracle
    out = engine.generate(ps, params)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    for a, b in zip(plain, out):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
    st = engine.stats()
    assert st["spec_accepted_tokens"] > st["spec_draft_tokens"] / 2 and st["kv_blocks_used"] == 0
    assert bool(st["prefill_graph_tokens"]) == graphs
    # with graphs every speculative step is two replays (spec_graph.py): verify as decode rows
    assert st["spec_graph_steps"] == (st["spec_steps"] if graphs else 0) and st["spec_steps"] > 0


def test_sampled_speculation_reports_the_models_logprobs_in_bf16():
    hf = _tiny(torch.bfloat16)
    ps = _prompts(4, seed=1)
    engine = Engine(hf, None, max_model_len=256, draft=head_for(hf).cuda(), num_draft=3, spec_max_batch=8)
    outs = engine.generate(ps, SamplingParams(max_tokens=30, temperature=1.0))
    for p, c in zip(ps, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([p + c.token_ids], device="cuda")).logits[0, len(p) - 1:-1].float()
        want = logits.log_softmax(-1).gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0]
        assert (torch.tensor(c.logprobs, device="cuda") - want).abs().mean() < 0.05
    st = engine.stats()
    assert st["spec_draft_tokens"] > 0 and st["kv_blocks_used"] == 0
    assert st["spec_graph_steps"] == st["spec_steps"] > 0


def test_graph_steps_after_a_weight_update_draft_from_the_new_weights():
    """An in-flight weight update changes lm_head in place; the graph's draft-vocabulary rows
    (a copy) must follow, or drafts would come from the old weights: greedy outputs after the
    update equal a fresh engine's on the new weights."""
    hf = _tiny()
    ps = _prompts(3, seed=2)
    params = SamplingParams(max_tokens=24, temperature=0)
    engine = Engine(hf, None, max_model_len=256, draft=head_for(hf).cuda(), num_draft=3, spec_max_batch=4)
    engine.generate(ps, params)
    # (named_parameters: the tied lm_head / embedding weight once, so both models get the same values)
    new = {n: t.detach() + 0.05 * torch.randn_like(t) for n, t in hf.named_parameters() if n.endswith("weight")}
    engine.update_weights(new, version=1)
    hf.load_state_dict(new, strict=False)
    want = Engine(hf, None, max_model_len=256).generate(ps, params)
    got = engine.generate(ps, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    rows = engine.speculator._rows()
    assert torch.equal(rows, engine.model.lm_head.weight.index_select(0, engine.speculator.head.draft_vocab))
