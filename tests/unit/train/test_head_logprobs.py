"""The chunked output layer + log-prob (``train/head_logprobs.py``) against the plain
``log_softmax(hidden @ W.T + b)`` path: the same values, entropies and gradients."""

from __future__ import annotations

import pytest
import torch

from opencomposer.train.head_logprobs import head_token_logprobs


def _plain(hidden, weight, bias, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    logp = logits.log_softmax(-1)
    return logp.gather(-1, targets[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk, temperature, with_bias", [(1, 1.0, False), (7, 0.7, True), (1000, 1.3, False)])
def test_values_entropy_and_gradients_equal_the_plain_path(chunk, temperature, with_bias):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=g)
    weight = torch.randn(50, 16, generator=g) * 0.5
    bias = torch.randn(50, generator=g) if with_bias else None
    targets = torch.randint(0, 50, (3, 11), generator=g)
    upstream = torch.randn(3, 11, generator=g)  # any per-token weights, as grpo_loss gives

    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight) + ((bias,) if with_bias else ())]
    lp, ent = head_token_logprobs(leaves[0], leaves[1], leaves[2] if with_bias else None, targets, temperature, chunk)
    (lp * upstream).sum().backward()
    ref_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight) + ((bias,) if with_bias else ())]
    ref_lp, ref_ent = _plain(ref_leaves[0], ref_leaves[1], ref_leaves[2] if with_bias else None, targets, temperature)
    (ref_lp * upstream).sum().backward()

    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    assert not ent.requires_grad
    for mine, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-4, atol=1e-5)


def test_without_grad_or_entropy_and_bad_inputs():
    hidden, weight, targets = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([0, 3, 9, 2])
    with torch.no_grad():
        lp, ent = head_token_logprobs(hidden, weight, None, targets, entropy=False, chunk_tokens=3)
    torch.testing.assert_close(lp, _plain(hidden, weight, None, targets, 1.0)[0])
    assert not ent.any()
    with pytest.raises(ValueError, match="targets out of range"):
        head_token_logprobs(hidden, weight, None, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match=r"weight \(10, 7\): expected \(vocab, 8\)"):
        head_token_logprobs(hidden, torch.randn(10, 7), None, targets)
    with pytest.raises(ValueError, match="chunk_tokens >= 1"):
        head_token_logprobs(hidden, weight, None, targets, chunk_tokens=0)
