"""The engine's sampler (``inference/engine/sampler.py``) draws from the distribution it reports:
token frequencies against softmax(logits / T), with top-k / top-p truncation, seeded rows
reproducible whatever else is in the batch, zero-probability tokens never drawn, and a
sliver of mass at the end of a large vocabulary still reachable (the fp64 cumulative sum)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opencomposer.inference.engine.sampler import draw, plain_inputs, race, sample, sample_plain
from opencomposer.inference.engine.sequence import SamplingParams, Sequence

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0, 0.5])


def _seqs(n: int, **kw) -> list[Sequence]:
    return [Sequence(str(i), [1], SamplingParams(**kw)) for i in range(n)]


def _freq(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=len(LOGITS)).double() / len(tokens)


def test_plain_rows_draw_from_softmax_over_temperature_and_report_its_logprob():
    torch.manual_seed(0)
    n = 40_000
    seqs = _seqs(n, temperature=0.7) + _seqs(2, temperature=0)
    logits = LOGITS.repeat(n + 2, 1)
    out = sample_plain(logits, torch.tensor(plain_inputs(seqs)))
    tokens = out[0].long()
    p = torch.softmax(LOGITS / 0.7, -1).double()
    assert (_freq(tokens[:n]) - p).abs().max() < 0.01
    assert tokens[n:].tolist() == [0, 0]  # greedy rows: the argmax
    ref = torch.log_softmax(logits / 0.7, -1).gather(1, tokens[:, None])[:n, 0]
    assert (out[1][:n] - ref.double()).abs().max() < 1e-6


def test_truncated_and_seeded_rows():
    torch.manual_seed(1)
    n = 20_000
    logits = LOGITS.repeat(n, 1)
    tokens, logprobs, _ = sample(logits, _seqs(n, temperature=1.0, top_k=2))
    freq = _freq(torch.tensor(tokens))
    p = torch.softmax(LOGITS[:2], -1).double()
    assert freq[2:].sum() == 0 and (freq[:2] - p).abs().max() < 0.015
    # logprobs are reported before truncation (the trainer's convention)
    assert abs(logprobs[0] - torch.log_softmax(LOGITS, -1)[tokens[0]].item()) < 1e-6
    # top_p 0.8: tokens 0, 1 and 5 (0.56 + 0.21 = 0.77 above 5, 0.90 above the next)
    tokens, _, _ = sample(logits, _seqs(n, temperature=1.0, top_p=0.8))
    freq = _freq(torch.tensor(tokens))
    kept = torch.zeros(len(LOGITS), dtype=torch.double)
    kept[[0, 1, 5]] = torch.softmax(LOGITS, -1).double()[[0, 1, 5]]
    assert set(torch.tensor(tokens).unique().tolist()) == {0, 1, 5}
    assert (freq - kept / kept.sum()).abs().max() < 0.015
    # a seeded row gives the same token alone and among other rows, for every seed
    for seed in range(40):
        alone = sample(LOGITS[None], _seqs(1, temperature=1.0, seed=seed))[0]
        mixed = _seqs(3, temperature=1.0)
        mixed[1] = _seqs(1, temperature=1.0, seed=seed)[0]
        assert sample(LOGITS.repeat(3, 1), mixed)[0][1] == alone[0]


def test_draw_never_picks_zero_weight_and_reaches_a_sliver_late_in_a_large_vocabulary():
    w = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.0]] * 3)
    assert draw(w, torch.tensor([0.0, 0.74, 0.999999])).tolist() == [1, 1, 3]
    assert draw(w, torch.tensor([0.75])[:1].expand(3)).tolist() == [3, 3, 3]
    # 150,000 tokens; token 100,000 holds 1e-9 of the mass: a uniform inside its share must
    # give it (summed in fp32, the running total near 0.67 moves in steps of ~6e-8 and skips it)
    n, k, sliver = 150_000, 100_000, 1e-9
    big = torch.full((1, n), 1.0 / (n - 1), dtype=torch.float32)
    big[0, k] = sliver
    w = big.double()
    before, total = w[0, :k].sum().item(), w.sum().item()
    assert draw(big, torch.tensor([(before + sliver / 2) / total], dtype=torch.float64)).item() == k
    assert draw(big, torch.tensor([(before + 2 * sliver) / total], dtype=torch.float64)).item() == k + 1


def test_race_draws_in_proportion_to_the_weights_and_never_a_zero_weight():
    """``race`` (speculative graphs' draw): 20,000 draws a row over 6 tokens (unnormalised,
    two rows at once, one with zeros) against the weights' shares."""
    torch.manual_seed(0)
    w = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.5, 0.5], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    picks = torch.stack([race(w) for _ in range(20_000)])  # [draws, 2]
    for row in range(2):
        freq = torch.bincount(picks[:, row], minlength=6).float() / 20_000
        share = w[row] / w[row].sum()
        assert (freq - share).abs().max() < 0.015, (row, freq, share)
    assert not torch.isin(picks[:, 0], torch.tensor([0, 2])).any()


def test_seeded_streams_are_uniform_independent_and_go_on_where_they_stopped():
    from opencomposer.inference.engine.sampler import seeded_uniforms

    u = seeded_uniforms([7, 8, -3, 2**63 - 1], [0, 0, 0, 0], 20_000)
    assert u.shape == (4, 20_000) and (u >= 0).all() and (u < 1).all()
    for row in u:  # uniform: each tenth of [0, 1) holds ~2,000 of 20,000 (4 sigma is ~170)
        counts = np.histogram(row, bins=10, range=(0, 1))[0]
        assert abs(counts - 2_000).max() < 200, counts
    assert abs(np.corrcoef(u[0], u[1])[0, 1]) < 0.03 and abs(np.corrcoef(u[0, :-1], u[0, 1:])[0, 1]) < 0.03
    # numbers 5.. of a stream are numbers 5.. whatever was drawn before, in whatever company
    assert np.array_equal(seeded_uniforms([8, 7], [5, 0], 3)[0], u[1, 5:8])


def test_a_seed_out_of_range_is_a_clear_error():
    with pytest.raises(ValueError, match=r"seed=18446744073709551616 \(an int in \[-2\*\*63, 2\*\*63\)"):
        SamplingParams(seed=2**64).check()
