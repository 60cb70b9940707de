"""The Composer-style GRPO loss: per-token weighting, masking, clipping, KL estimators."""

from __future__ import annotations

import math

import pytest
import torch

from opencomposer.train.loss import LossConfig, grpo_loss, kl_per_token, token_logprobs


def _grad(logprobs, old, adv, mask, **kw):
    lp = logprobs.clone().requires_grad_(True)
    loss, stats = grpo_loss(lp, old, adv, mask, **kw)
    loss.backward()
    return lp.grad, loss, stats


def test_k1_and_k3_on_hand_computed_values():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # k1 = log p - log p_ref = log 2; k3 = r - log r - 1 with r = p_ref / p = 1/2.
    assert kl_per_token(lp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_per_token(lp, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1)  # 0.1931
    # Drifted far (p_ref / p = 100): k3 grows linearly in the ratio, k1 only logarithmically.
    lp2, ref2 = torch.tensor([math.log(0.001)]), torch.tensor([math.log(0.1)])
    assert kl_per_token(lp2, ref2, "k1").item() == pytest.approx(-math.log(100))
    assert kl_per_token(lp2, ref2, "k3").item() == pytest.approx(100 - math.log(100) - 1)


def test_kl_in_loss_and_stats():
    lp = torch.full((1, 2), math.log(0.5))
    ref = torch.full((1, 2), math.log(0.25))
    mask = torch.tensor([[1.0, 0.0]])
    for est, want in (("k1", math.log(2)), ("k3", 0.5 + math.log(2) - 1)):
        cfg = LossConfig(kl_coef=0.1, kl_estimator=est, normalizer=4.0)
        loss, stats = grpo_loss(lp, lp, torch.zeros(1), mask, ref_logprobs=ref, config=cfg)
        assert stats["kl"] == pytest.approx(want)  # mean over the one masked token
        assert loss.item() == pytest.approx(0.1 * want / 4.0)  # pg is 0 with A = 0
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        grpo_loss(lp, lp, torch.zeros(1), mask, config=LossConfig(kl_coef=0.1))


def test_short_and_long_sequences_get_the_same_per_token_gradient():
    T, adv = 30, torch.tensor([0.7, 0.7])
    mask = torch.zeros(2, T)
    mask[0, :3] = 1.0  # 3-token answer
    mask[1, :] = 1.0  # 30-token answer
    old = torch.randn(2, T).clamp(max=0) - 1.0
    lp = old.clone()  # ratio 1 on every token
    grad, _, stats = _grad(lp, old, adv, mask, config=LossConfig(normalizer=1000.0))
    assert stats["tokens"] == 33
    assert torch.allclose(grad[0, :3], torch.full((3,), -0.7 / 1000.0))
    assert torch.allclose(grad[1], torch.full((T,), -0.7 / 1000.0))

    # Contrast: GRPO's per-sequence mean gives a short-answer token 10x the weight.
    lpg = lp.clone().requires_grad_(True)
    per_tok = -torch.exp(lpg - old) * adv[:, None] * mask
    (per_tok.sum(1) / mask.sum(1)).mean().backward()
    assert lpg.grad[0, 0] / lpg.grad[1, 0] == pytest.approx(10.0)


def test_masked_tokens_get_exactly_zero_gradient():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    old = -torch.rand(2, 6) * 3
    lp = old + 0.1 * torch.randn(2, 6)
    lp[1, 5] = old[1, 5] = float("-inf")  # padding with -inf must not leak nan
    ref = -torch.rand(2, 6) * 3
    cfg = LossConfig(kl_coef=0.5)
    grad, loss, _ = _grad(lp, old, torch.tensor([1.0, -2.0]), mask, ref_logprobs=ref, config=cfg)
    assert torch.isfinite(loss)
    assert torch.all(grad[~mask] == 0.0)
    assert torch.all(grad[mask] != 0.0)


def test_clipped_tokens_get_zero_pg_gradient():
    cfg = LossConfig(clip_low=0.2, clip_high=0.28)
    log_r = torch.tensor([[math.log(1.5), math.log(1.1), math.log(0.5)]])
    old = torch.full((1, 3), -1.0)
    mask = torch.ones(1, 3)
    # A > 0: ratio above 1 + clip_high is clipped (zero grad); inside the range is not.
    # Below 1 - clip_low with A > 0 the unclipped term is the minimum, so that token
    # still has gradient: PPO only stops moves that would overshoot in A's direction.
    grad, _, stats = _grad(old + log_r, old, torch.tensor([1.0]), mask, config=cfg)
    assert grad[0, 0] == 0.0
    assert grad[0, 1] != 0.0 and grad[0, 2] != 0.0
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
    # A < 0: the mirror image, ratio below 1 - clip_low is clipped.
    grad, _, stats = _grad(old + log_r, old, torch.tensor([-1.0]), mask, config=cfg)
    assert grad[0, 2] == 0.0
    assert grad[0, 0] != 0.0 and grad[0, 1] != 0.0
    assert stats["ratio_max"] == pytest.approx(1.5)
    assert stats["ratio_mean"] == pytest.approx(3.1 / 3)


def test_shape_mismatch_errors_name_the_tensor():
    lp, mask = torch.zeros(2, 5), torch.ones(2, 5)
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(2, 4\), expected \(2, 5\)"):
        grpo_loss(lp, torch.zeros(2, 4), torch.zeros(2), mask)
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 1\), expected \(2,\)"):
        grpo_loss(lp, lp, torch.zeros(2, 1), mask)
    with pytest.raises(ValueError, match=r"target_ids has shape \(2, 3\)"):
        token_logprobs(torch.zeros(2, 4, 7), torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("chunk_size", [3, 512])
def test_token_logprobs_matches_direct_computation(chunk_size):
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 10, 50)).requires_grad_(True)
    targets = torch.randint(0, 50, (2, 10))
    lp, ent = token_logprobs(logits, targets, temperature=0.7, chunk_size=chunk_size)

    ref_logits = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(ref_logits / 0.7, dim=-1)
    want_lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want_ent = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(lp, want_lp, atol=1e-5)
    assert torch.allclose(ent, want_ent, atol=1e-5)
    assert not ent.requires_grad

    w = torch.randn(2, 10)  # gradients through the checkpointed chunks match too
    (lp * w).sum().backward()
    (want_lp * w).sum().backward()
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-5)


def test_token_logprobs_handles_masked_vocab():
    logits = torch.tensor([[[0.0, 0.0, float("-inf")]]])
    lp, ent = token_logprobs(logits, torch.tensor([[1]]))
    assert lp.item() == pytest.approx(math.log(0.5))
    assert ent.item() == pytest.approx(math.log(2))


def test_mismatch_is_measured_and_corrected_by_importance_weights():
    # trainer vs sampler log-probs on 4 tokens: p_trainer / p_sampler = 1, 1.5, 4, 0.25
    w = torch.tensor([[1.0, 1.5, 4.0, 0.25]])
    old = torch.full((1, 4), -2.0)
    lp = old + torch.log(w)
    mask = torch.ones(1, 4)
    adv = torch.tensor([1.0])
    norm = LossConfig(normalizer=10.0)

    # none: the ratio is to the sampler, so the 1.5 and 4 tokens are clipped (A > 0) and have no gradient
    grad, _, stats = _grad(lp, old, adv, mask, config=norm)
    assert stats["mismatch_kl"] == pytest.approx(-float(torch.log(w).mean()))  # mean log(p_sampler / p_trainer)
    assert stats["mismatch_max"] == pytest.approx(math.log(4))
    assert stats["is_corrected_fraction"] == 0.0
    assert grad[0, 1] == 0.0 and grad[0, 2] == 0.0 and grad[0, 0] != 0.0

    # truncate: the ratio is to the trainer's own log-probs (1 everywhere, nothing clipped) and each
    # token's gradient -A * w / normalizer has w capped at 2
    cfg = LossConfig(normalizer=10.0, is_correction="truncate", is_cap=2.0)
    grad, loss, stats = _grad(lp, old, adv, mask, config=cfg)
    assert torch.allclose(grad, -torch.tensor([[1.0, 1.5, 2.0, 0.25]]) / 10.0)
    assert loss.item() == pytest.approx(-(1.0 + 1.5 + 2.0 + 0.25) / 10.0)
    assert stats["is_corrected_fraction"] == pytest.approx(1 / 4) and stats["clip_fraction"] == 0.0
    assert stats["mismatch_kl"] == pytest.approx(-float(torch.log(w).mean()))  # measured the same way

    # mask: tokens whose weight is outside [1/2, 2] are dropped, the others weighted
    cfg = LossConfig(normalizer=10.0, is_correction="mask", is_cap=2.0)
    grad, _, stats = _grad(lp, old, adv, mask, config=cfg)
    assert torch.allclose(grad, -torch.tensor([[1.0, 1.5, 0.0, 0.0]]) / 10.0)
    assert stats["is_corrected_fraction"] == pytest.approx(2 / 4)

    # sampler and trainer in agreement: every mode is the plain policy gradient, mismatch 0
    for mode in ("none", "truncate", "mask"):
        grad, _, stats = _grad(old, old, adv, mask, config=LossConfig(normalizer=10.0, is_correction=mode))
        assert torch.allclose(grad, torch.full((1, 4), -0.1)) and stats["mismatch_kl"] == 0.0


def test_bad_importance_settings_are_refused():
    with pytest.raises(ValueError, match="is_cap must be > 1, got 1.0"):
        LossConfig(is_correction="truncate", is_cap=1.0)
    with pytest.raises(ValueError, match="is_correction must be 'none', 'truncate' or 'mask', got 'clip'"):
        LossConfig(is_correction="clip")
    with pytest.raises(ValueError, match="is_level must be 'token' or 'sequence', got 'segment'"):
        LossConfig(is_correction="truncate", is_level="segment")


def _three_sequences():
    """Three padded rows with trainer-over-sampler log-ratios whose means per row are log(4^(2/3)),
    0 and -log 4: above, inside and below [1/2, 2] at sequence level (cap 2). Row 1's tokens are
    4 and 1/4 apart, so at token level it would be capped and masked. -inf marks padding."""
    pad = float("-inf")
    log_r = torch.tensor([[math.log(4), math.log(4), 0.0, 0.0],
                          [math.log(4), -math.log(4), 0.0, 0.0],
                          [-math.log(4), 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    old = torch.where(mask, torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-3.0, -1.5, 0.0, 0.0], [-2.5, 0.0, 0.0, 0.0]]),
                      pad)
    lp = torch.where(mask, old + log_r, pad)
    return lp, old, torch.tensor([1.0, -0.5, 2.0]), mask


def test_sequence_level_with_agreeing_logprobs_changes_nothing():
    lp, _, adv, mask = _three_sequences()
    want_grad, want_loss, want = _grad(lp, lp, adv, mask, config=LossConfig(normalizer=10.0))
    for mode in ("truncate", "mask"):
        cfg = LossConfig(normalizer=10.0, is_correction=mode, is_level="sequence", is_cap=2.0)
        grad, loss, stats = _grad(lp, lp, adv, mask, config=cfg)
        assert loss.item() == want_loss.item()
        assert torch.equal(grad, want_grad)
        assert stats["is_corrected_fraction"] == 0.0 and stats["sequences"] == 3.0 and stats["mismatch_kl"] == 0.0


def test_sequence_level_weights_truncate_or_mask_whole_sequences():
    lp, old, adv, mask = _three_sequences()
    # the ratio is to the trainer's own log-probs (1 everywhere), so each loss token's term is -w_seq * A / 10:
    # row 0: w = 4^(2/3) = 2.52 -> 2, A = 1, 3 tokens; row 1: w = 1, A = -0.5, 2 tokens; row 2: w = 1/4, A = 2
    cfg = LossConfig(normalizer=10.0, is_correction="truncate", is_level="sequence", is_cap=2.0)
    grad, loss, stats = _grad(lp, old, adv, mask, config=cfg)
    assert loss.item() == pytest.approx((-2.0 * 3 + 0.5 * 2 - 0.25 * 2.0) / 10.0)  # -0.55
    want = torch.tensor([[-0.2, -0.2, -0.2, 0.0], [0.05, 0.05, 0.0, 0.0], [-0.05, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(grad, want)
    assert stats["is_corrected_fraction"] == pytest.approx(1 / 3) and stats["sequences"] == 3.0
    assert stats["mismatch_kl"] == pytest.approx(-(2 * math.log(4) - math.log(4)) / 6)  # still per token

    # mask: rows 0 and 2 (weights outside [1/2, 2]) are dropped whole; row 1 is untouched
    cfg = LossConfig(normalizer=10.0, is_correction="mask", is_level="sequence", is_cap=2.0)
    grad, loss, stats = _grad(lp, old, adv, mask, config=cfg)
    assert loss.item() == pytest.approx(0.5 * 2 / 10.0)
    want = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.05, 0.05, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(grad, want)
    assert stats["is_corrected_fraction"] == pytest.approx(2 / 3)

    # token level on the same batch weighs row 1's tokens 2 (capped 4) and 1/4: another loss
    cfg = LossConfig(normalizer=10.0, is_correction="truncate", is_cap=2.0)
    _, loss, stats = _grad(lp, old, adv, mask, config=cfg)
    assert loss.item() == pytest.approx((-(2.0 + 2.0 + 1.0) + 0.5 * (2.0 + 0.25) - 0.25 * 2.0) / 10.0)
    assert stats["is_corrected_fraction"] == pytest.approx(3 / 6)  # tokens: 4, 4 (row 0) and 4 (row 1)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_sequence_level_packed_row_equals_the_padded_rows(mode):
    lp, old, adv, mask = _three_sequences()
    lengths = [int(n) for n in mask.sum(1)]
    # the three sequences end to end in one row (plus one padding token), as train/micro_batches.py packs them
    cat = [torch.cat([t[i, :n] for i, n in enumerate(lengths)] + [t.new_tensor([pad])])[None]
           for t, pad in ((lp, float("-inf")), (old, float("-inf")), (mask, False))]
    seq_ids = torch.tensor([[i for i, n in enumerate(lengths) for _ in range(n)] + [2]])
    adv_tok = torch.tensor([[float(adv[i]) for i, n in enumerate(lengths) for _ in range(n)] + [0.0]])
    cfg = LossConfig(normalizer=10.0, is_correction=mode, is_level="sequence", is_cap=2.0)

    grad, loss, stats = _grad(lp, old, adv, mask, config=cfg)
    p_grad, p_loss, p_stats = _grad(cat[0], cat[1], adv_tok, cat[2], config=cfg, seq_ids=seq_ids)
    assert p_loss.item() == pytest.approx(loss.item())
    torch.testing.assert_close(p_grad[0, :-1], grad[mask])
    assert p_grad[0, -1] == 0.0
    assert p_stats == pytest.approx(stats)
    # without seq_ids the packed row is one sequence (mean log-ratio log(4)/6: inside the bounds)
    _, whole, w_stats = _grad(cat[0], cat[1], adv_tok, cat[2], config=cfg)
    assert whole.item() == pytest.approx(-(3 * 1.0 - 2 * 0.5 + 2.0) * 4 ** (1 / 6) / 10.0)
    assert w_stats["sequences"] == 1.0 and w_stats["is_corrected_fraction"] == 0.0


def test_bad_sequence_ids_are_refused():
    lp, mask = torch.zeros(1, 3), torch.ones(1, 3)
    with pytest.raises(ValueError, match=r"seq_ids has shape \(1, 2\), expected \(1, 3\)"):
        grpo_loss(lp, lp, torch.zeros(1), mask, seq_ids=torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="seq_ids must be integers >= 0"):
        grpo_loss(lp, lp, torch.zeros(1), mask, seq_ids=torch.tensor([[0, -1, 1]]))
