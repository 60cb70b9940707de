"""Speculative decoding with an MTP head (``inference/engine/speculate.py``) on tiny models (CPU, fp32):
the same tokens as plain decoding when greedy, exactly the model's distribution when
sampling, the model's logprobs, stops and limits inside kept drafts, no leaked KV blocks."""

from __future__ import annotations

import pytest
import torch

from opencomposer.inference.engine.core import Engine, SamplingParams
from opencomposer.inference.engine.sequence import Sequence
from opencomposer.inference.engine.sampler import uniforms
from opencomposer.inference.engine.acceptance import accept
from opencomposer.inference.engine.speculate import Speculator
from opencomposer.models.mtp import MTPError, MTPHead
from opencomposer.train.mtp import head_for

GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture
def hf(tiny_hf):
    return tiny_hf("qwen2")


def _head(hf, seed: int = 0) -> MTPHead:
    torch.manual_seed(seed)
    head = head_for(hf)
    torch.nn.init.normal_(head.down.weight, std=0.1)  # a random head: its drafts are mostly wrong
    return head


class _Oracle(Speculator):
    """A drafter that knows greedy decoding's answer (a test double for the head): it drafts
    the true next tokens, but spoils one in three, so steps keep 0..k drafts."""

    def __init__(self, model, head, k, answers: dict[tuple, list[int]]):
        super().__init__(model, head, k, max_batch=8)
        self.answers, self.calls = answers, 0

    def _store(self, seqs, drafts, q, new):
        for s, n in zip(seqs, new):
            done = s.completion_ids + n
            truth = next(a for p, a in self.answers.items() if list(p) == s.token_ids[:s.num_prompt])
            d = truth[len(done):len(done) + self.k]
            self.calls += 1
            if self.calls % 3 == 0 and d:
                d = d[:-1] + [(d[-1] + 1) % 97]
            # drafts fixed by the context: their distribution is a point mass on each
            s.draft = d
            s.draft_q = None if s.params.temperature == 0 else torch.nn.functional.one_hot(
                torch.tensor(d, dtype=torch.long), 97).float()


def _oracle_engine(hf, answers, k=4, max_model_len=128, **kw):
    engine = Engine(hf, None, max_model_len=max_model_len, block_size=4, draft=_head(hf), num_draft=k, **kw)
    engine.speculator = _Oracle(engine.model, engine.speculator.head, k, answers)
    engine.speculator.attach(engine.runner)
    return engine


def test_greedy_speculation_gives_plain_decodings_tokens_and_logprobs(hf, prompts):
    ps = prompts(5, seed=3)
    base = Engine(hf, None, max_model_len=128, block_size=4)
    plain = base.generate(ps, GREEDY)
    # a random head: nearly every draft rejected, one token a step
    spec = Engine(hf, None, max_model_len=128, block_size=4, draft=_head(hf), num_draft=3, spec_max_batch=8)
    for a, b in zip(plain, spec.generate(ps, GREEDY)):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    # a drafter that is mostly right: several tokens a step, still the same tokens
    oracle = _oracle_engine(hf, {tuple(p): c.token_ids for p, c in zip(ps, plain)})
    out = oracle.generate(ps, GREEDY)
    for a, b in zip(plain, out):
        assert b.token_ids == a.token_ids and b.policy_versions == a.policy_versions
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    st = oracle.stats()
    assert st["spec_accepted_tokens"] > st["spec_draft_tokens"] / 2
    assert st["steps"] < base.stats()["steps"] * 0.7  # several tokens a step
    assert st["kv_blocks_used"] == spec.stats()["kv_blocks_used"] == 0


def test_a_stop_inside_kept_drafts_ends_the_sequence_there(hf, prompts):
    p = prompts(1, seed=4)[0]
    full = Engine(hf, None, max_model_len=128).generate([p], SamplingParams(max_tokens=30, temperature=0))[0]
    stop = full.token_ids[9]  # a token the drafter will propose inside a run of drafts
    first = full.token_ids.index(stop)
    engine = _oracle_engine(hf, {tuple(p): full.token_ids}, k=6)
    rid = engine.add_request(p, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(stop,)))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    c = engine.completion(rid)
    assert c.token_ids == full.token_ids[:first + 1] and c.finish_reason == "stop"
    assert [t for o in outs for t in o.new_token_ids] == c.token_ids  # one StepOutput per step, all tokens
    assert max(len(o.new_token_ids) for o in outs) > 1
    # max_tokens inside a run of drafts: exactly max_tokens tokens
    engine2 = _oracle_engine(hf, {tuple(p): full.token_ids}, k=6)
    c2 = engine2.generate([p], SamplingParams(max_tokens=11, temperature=0))[0]
    assert c2.token_ids == full.token_ids[:11] and c2.finish_reason == "length"
    assert engine.stats()["kv_blocks_used"] == engine2.stats()["kv_blocks_used"] == 0


def test_rejection_sampling_reproduces_the_models_distribution():
    """``accept`` on fixed p (3 rows) and q (2 drafts) over 6 tokens, 3,000 trials: the first
    token is distributed as p0, and the second (when the first was a kept draft) as p1."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g) * 1.5
    q = torch.softmax(-logits[:2] + torch.randn(2, 6, generator=g), -1)  # a head far from the model
    p = torch.softmax(logits, -1)
    seq = Sequence("r", [1, 2], SamplingParams(temperature=1.0, max_tokens=8, seed=7))
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(3_000):
        d = [int(torch.multinomial(q[0], 1, generator=g)), int(torch.multinomial(q[1], 1, generator=g))]
        n_keep, tokens, chosen, _ = accept(logits[None], torch.tensor([d]), torch.tensor([2]), torch.tensor([1.0]),
                                           torch.tensor([False]), None, q[None], uniforms([seq], 5, "cpu"))
        n = int(n_keep[0]) + 1
        toks, lps = tokens[0, :n].tolist(), chosen[0, :n].tolist()
        first[toks[0]] += 1
        if len(toks) > 1:
            second[toks[1]] += 1
        assert lps[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[toks[0]]), abs=1e-6)
    tv1 = 0.5 * (first / first.sum() - p[0]).abs().sum()
    tv2 = 0.5 * (second / second.sum() - p[1]).abs().sum()
    assert tv1 < 0.05 and tv2 < 0.07, (tv1, tv2)  # sampling noise: ~0.016 and ~0.02
    # always accepting the draft would have given q0: far away
    assert 0.5 * (q[0] - p[0]).abs().sum() > 0.3 and 0.5 * (q[1] - p[1]).abs().sum() > 0.3


def test_sampled_speculation_reports_the_models_logprobs(hf, prompts):
    ps = prompts(3, seed=8)
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=11)
    engine = Engine(hf, None, max_model_len=128, block_size=4, draft=_head(hf), num_draft=2, spec_max_batch=8)
    for p, c in zip(ps, engine.generate(ps, [params] * 3)):
        ids = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1:-1].float() / 0.8
        want = logits.log_softmax(-1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-4)
    st = engine.stats()
    assert st["spec_draft_tokens"] > 0 and st["kv_blocks_used"] == 0
    # the same seed, the same engine settings: the same tokens
    again = Engine(hf, None, max_model_len=128, block_size=4, draft=_head(hf), num_draft=2,
                   spec_max_batch=8).generate(ps, [params] * 3)
    assert [c.token_ids for c in again] == [c.token_ids for c in engine.generate(ps, [params] * 3)]


def test_drafts_take_only_free_blocks(hf, prompts):
    """A cache of 24 blocks of 4 for 6 sequences: drafts shrink or wait; outputs stay plain decoding's."""
    ps = prompts(6, seed=9, lo=10, hi=14)
    params = SamplingParams(max_tokens=6, temperature=0)
    plain = Engine(hf, None, max_model_len=64, block_size=4).generate(ps, params)
    engine = _oracle_engine(hf, {tuple(p): c.token_ids for p, c in zip(ps, plain)}, k=5, kv_blocks=24, max_model_len=64)
    assert [c.token_ids for c in engine.generate(ps, params)] == [c.token_ids for c in plain]
    assert engine.stats()["kv_blocks_used"] == 0


def test_bad_speculation_settings_are_named(hf, tmp_path):
    with pytest.raises(ValueError, match="num_draft=0"):
        Engine(hf, None, max_model_len=64, draft=_head(hf), num_draft=0)
    with pytest.raises(ValueError, match="run_ahead=True and draft="):
        Engine(hf, None, max_model_len=64, draft=_head(hf), run_ahead=True, cuda_graphs="eager")
    with pytest.raises(MTPError, match="mtp.json: no such file"):
        Engine(hf, None, max_model_len=64, draft=tmp_path / "nohead")
    other = head_for(hf)
    other.cfg.hidden_size = 32
    MTPHead(other.cfg).save(tmp_path / "small")
    with pytest.raises(MTPError, match="hidden_size=32 but the model it would draft for has hidden_size=64"):
        Engine(hf, None, max_model_len=64, draft=tmp_path / "small")
    _head(hf).save(tmp_path / "ok")  # a saved head loads and drafts
    engine = Engine(hf, None, max_model_len=64, draft=tmp_path / "ok")
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0))[0].token_ids


def test_top_logprobs_of_every_token_of_a_speculative_step(hf, prompts):
    ps = prompts(2, seed=12)
    params = [SamplingParams(max_tokens=12, temperature=0.7, top_logprobs=3), SamplingParams(max_tokens=12, temperature=0)]
    plain = Engine(hf, None, max_model_len=128, block_size=4).generate(ps, SamplingParams(max_tokens=12, temperature=0))
    engine = _oracle_engine(hf, {tuple(p): c.token_ids for p, c in zip(ps, plain)}, k=3)
    sampled, greedy = engine.generate(ps, params)
    assert greedy.token_ids == plain[1].token_ids and greedy.top_logprobs == []
    with torch.no_grad():
        logits = hf(torch.tensor([ps[0] + sampled.token_ids])).logits[0, len(ps[0]) - 1:-1].float() / 0.7
    values, ids = logits.log_softmax(-1).topk(3, dim=-1)
    assert len(sampled.top_logprobs) == len(sampled.token_ids) == 12
    for j, top in enumerate(sampled.top_logprobs):
        assert [t for t, _ in top] == ids[j].tolist()
        assert [v for _, v in top] == pytest.approx(values[j].tolist(), abs=1e-4)


def test_batches_over_spec_max_batch_step_plainly(hf, prompts):
    ps = prompts(4, seed=13)
    params = SamplingParams(max_tokens=16, temperature=0)
    base = Engine(hf, None, max_model_len=128, block_size=4)
    plain = base.generate(ps, params)
    engine = Engine(hf, None, max_model_len=128, block_size=4, draft=_head(hf), num_draft=2, spec_max_batch=2)
    rids = [engine.add_request(p, params) for p in ps[:3]]  # 3 > 2: plain steps ...
    for _ in range(4):
        engine.step()
    assert engine.stats()["spec_steps"] == 0
    engine.abort(rids[2])  # ... then 2 sequences: speculative steps
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["spec_steps"] > 0 and engine.stats()["kv_blocks_used"] == 0
    assert [engine.completion(r).token_ids for r in rids[:2]] == [c.token_ids for c in plain[:2]]
    with pytest.raises(ValueError, match="spec_max_batch=0"):
        Engine(hf, None, max_model_len=64, draft=_head(hf), spec_max_batch=0)


# ---------------------------------------------------------------- the graph path (spec_graph.py)
# ``cuda_graphs="eager"`` runs the graphs' bodies on their static buffers: the decode rows of
# each sequence's last token and drafts, the accept and the draft chain in fixed shapes.


def test_graph_steps_give_plain_decodings_tokens_and_logprobs(hf, prompts):
    ps = prompts(5, seed=21)
    base = Engine(hf, None, max_model_len=128, block_size=4)
    plain = base.generate(ps, GREEDY)
    answers = {tuple(p): c.token_ids for p, c in zip(ps, plain)}
    oracle = _oracle_engine(hf, answers, k=4, cuda_graphs="eager", spec_max_batch=8)
    assert oracle.runner.decode_bucket(5 * 5) is not None  # the engine captured rows for 8 x (4 + 1)
    out = oracle.generate(ps, GREEDY)
    for a, b in zip(plain, out):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    st = oracle.stats()
    assert st["spec_graph_steps"] == st["spec_steps"] > 0  # every speculative step through the graphs
    assert st["spec_accepted_tokens"] > st["spec_draft_tokens"] / 2
    assert st["steps"] < base.stats()["steps"] * 0.7 and st["kv_blocks_used"] == 0
    # the head itself drafting (mostly rejected): the same tokens again
    spec = Engine(hf, None, max_model_len=128, block_size=4, draft=_head(hf), num_draft=3, spec_max_batch=8,
                  cuda_graphs="eager")
    assert [c.token_ids for c in spec.generate(ps, GREEDY)] == [c.token_ids for c in plain]
    assert spec.stats()["spec_graph_steps"] > 0 and spec.stats()["kv_blocks_used"] == 0


def test_graph_steps_sample_with_the_models_logprobs(hf, prompts):
    ps = prompts(3, seed=22)
    params = SamplingParams(max_tokens=20, temperature=0.8)
    engine = Engine(hf, None, max_model_len=128, block_size=4, draft=_head(hf), num_draft=2, spec_max_batch=4,
                    cuda_graphs="eager")
    mixed = [params, SamplingParams(max_tokens=20, temperature=0), params]
    outs = engine.generate(ps, mixed)
    for p, c, sp in zip(ps, outs, mixed):
        with torch.no_grad():
            logits = hf(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1].float() / (sp.temperature or 1.0)
        want = logits.log_softmax(-1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-4)
    st = engine.stats()
    assert st["spec_graph_steps"] == st["spec_steps"] > 0 and st["kv_blocks_used"] == 0
    # rows that are not plain (top-p here) take the eager step
    before = st["spec_graph_steps"]
    engine.generate(ps[:1], SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9))
    after = engine.stats()
    assert after["spec_graph_steps"] == before and after["spec_steps"] > st["spec_steps"]


def test_graph_rejection_sampling_reproduces_the_models_distribution(hf):
    """The graph body's accept (uniforms drawn inside) on fixed logits (3 rows) and q (2 drafts
    from a distribution far from the model's), 3,000 replays: the first token is distributed
    as p0, the second (after a kept draft) as p1."""
    engine = Engine(hf, None, max_model_len=64, block_size=4, draft=_head(hf), num_draft=2, cuda_graphs="eager")
    graphs, (_, logits) = engine.speculator.graphs, engine.runner.decode_outputs()
    vocab = logits.shape[-1]
    g = torch.Generator().manual_seed(0)
    rows = torch.full((3, vocab), -30.0)  # 6 likely tokens, so 3,000 draws estimate p well
    rows[:, :6] = torch.randn(3, 6, generator=g) * 1.5
    p = rows.softmax(-1)
    q = torch.zeros(2, vocab)
    q[:, :6] = torch.softmax(-rows[:2, :6] + torch.randn(2, 6, generator=g), -1)
    st = graphs.static
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    torch.manual_seed(1)
    for _ in range(3_000):
        with torch.inference_mode():  # (the engine's buffers are inference tensors)
            _fill(logits, st, rows, q, g)  # the decode graph's output buffer, as a verify step leaves it
        d = [int(t) for t in st["packed"][0, :2].tolist()]
        graphs.graphs[1, True].replay()
        out = st["out"][0].tolist()
        n = int(out[0]) + 1
        toks = [int(t) for t in out[1:1 + n]]
        assert toks[:n - 1] == d[:n - 1]
        assert out[4] == pytest.approx(float(rows[0].log_softmax(-1)[toks[0]]), abs=1e-5)
        first[toks[0]] += 1
        if n > 1:
            second[toks[1]] += 1
    tv1 = 0.5 * (first / first.sum() - p[0]).abs().sum()
    tv2 = 0.5 * (second / second.sum() - p[1]).abs().sum()
    assert tv1 < 0.05 and tv2 < 0.1, (tv1, tv2)  # sampling noise: ~0.02 and ~0.05 (~250 second tokens)
    assert 0.5 * (q[0] - p[0]).abs().sum() > 0.3  # always keeping the draft would have given q0: far away


def _fill(logits, st, rows, q, g) -> None:
    """Set a verify step's outputs (``rows``: the model's logits at the last token and two
    drafts) and inputs (two drafts drawn from ``q``, T = 1, sampled) in the graph's buffers."""
    logits[:3] = rows  # the decode graph's output buffer, as a verify step leaves it
    d = [int(torch.multinomial(q[0], 1, generator=g)), int(torch.multinomial(q[1], 1, generator=g))]
    st["packed"][0] = torch.tensor(d + [2, 1.0, 0.0], dtype=torch.float64)
    st["q"][0] = q


def test_a_weight_update_reaches_the_draft_rows(hf, prompts):
    """lm_head's draft-vocabulary rows are a copy (a captured graph reads it): an in-flight
    weight update must refresh it in place (a version check missed writes through ``.data``)."""
    engine = Engine(hf, None, max_model_len=64, block_size=4, draft=_head(hf), num_draft=2, cuda_graphs="eager")
    engine.generate(prompts(1, seed=30), GREEDY)
    before = engine.speculator._rows()
    old = before.clone()
    new = {n: t.detach() + 0.05 * torch.randn_like(t) for n, t in hf.named_parameters() if n.endswith("weight")}
    engine.update_weights(new, version=1)
    rows = engine.speculator._rows()
    assert rows is before and not torch.equal(rows, old)  # the same buffer, new values
    assert torch.equal(rows, engine.model.lm_head.weight.index_select(0, engine.speculator.head.draft_vocab))
