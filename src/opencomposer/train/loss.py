"""The policy loss: GRPO as Composer 2 changed it, on padded token tensors.

Per token t of sequence b (only where ``loss_mask`` is 1, i.e. tokens the model
generated; prompt and tool-output tokens are 0)::

    r      = exp(logprobs - old_logprobs)          # old = the SAMPLER's log-probs
    pg     = -min(r * A_b, clip(r, 1 - clip_low, 1 + clip_high) * A_b)
    kl     = logprobs - ref_logprobs               # k1 = -log(p_ref / p_theta)
    loss   = (sum(pg) + kl_coef * sum(kl)) / normalizer

Choices that follow the Composer 2 report (Cursor, 2026) rather than GRPO's paper:

* No per-sequence length normalisation. GRPO averages each sequence over its own
  length, so a token of a 3-token answer weighs 10x a token of a 30-token one: short
  wins are pushed up hardest, long failures are barely pushed down. Here the sum over
  all masked tokens is divided by one constant, ``normalizer`` (None -> B * T of this
  batch). Pass ``max_tokens * batch_size`` to keep the scale fixed across steps and
  across micro-batches of one optimizer step.
* KL by the k1 estimator. k3 (``exp(ref - lp) - (ref - lp) - 1``, selectable for
  comparison) is lower-variance near the reference but grows like ``p_ref/p_theta``
  once the policies drift, and its variance explodes with it.
* Asymmetric clipping is allowed (``clip_high > clip_low``, as in DAPO) so unlikely
  tokens with positive advantage can still gain probability.

    loss, stats = grpo_loss(logprobs, old_logprobs, advantages, loss_mask)
    loss.backward()

Train-inference mismatch (``is_correction``): the sampler (an inference engine, bf16, maybe a
few versions behind in async RL) and the trainer disagree on the same tokens' log-probs. Every
call measures it: ``mismatch_kl``, the mean of ``log p_sampler - log p_trainer`` over loss tokens
(the k1 estimate of KL(sampler || trainer); exact 0 when the two agree). ``"none"`` (default)
takes the ratio to the sampler's log-probs, so clipping bounds mismatch and policy change
together. ``"truncate"`` and ``"mask"`` decouple them (AReaL's decoupled PPO; TIS / MIS as in
verl): the ratio is taken to the trainer's own log-probs before the update (one optimizer step a
batch: those are ``logprobs`` detached), and each token is weighted by ``p_trainer / p_sampler``,
capped at ``is_cap`` (truncate) or zeroed outside ``[1/is_cap, is_cap]`` (mask); the share of
tokens so treated is ``is_corrected_fraction``. ``is_level = "sequence"`` weights a whole sequence
instead (one sample: a row, or with ``seq_ids`` one sample of a packed row) by the geometric mean of
its tokens' ratios, ``exp(mean over its loss tokens of (log p_trainer - log p_sampler))`` (length-
normalised as in GSPO, so a long sequence is not truncated for its length alone), capped at
``is_cap`` or, outside ``[1/is_cap, is_cap]``, dropping all its tokens; ``is_corrected_fraction``
is then the share of sequences so treated. Either way the weight is a constant (no gradient), and
``sequences`` counts the sequences with loss tokens.

``token_logprobs(logits, target_ids)`` turns model logits into the ``logprobs`` input.
Test: ``pytest tests/unit/train/test_loss.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["LossConfig", "grpo_loss", "kl_per_token", "token_logprobs"]


@dataclass
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k3"] = "k1"
    normalizer: float | None = None  # None -> B * T of each batch (see module docstring)
    is_correction: Literal["none", "truncate", "mask"] = "none"  # see "Train-inference mismatch" above
    is_cap: float = 2.0
    is_level: Literal["token", "sequence"] = "token"  # one importance weight per token, or per sequence

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0.0:
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self}")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {self.kl_estimator!r}")
        if self.normalizer is not None and not self.normalizer > 0:
            raise ValueError(f"normalizer must be > 0 or None, got {self.normalizer}")
        if self.is_correction not in ("none", "truncate", "mask"):
            raise ValueError(f"is_correction must be 'none', 'truncate' or 'mask', got {self.is_correction!r}")
        if not self.is_cap > 1.0:
            raise ValueError(f"is_cap must be > 1, got {self.is_cap}")
        if self.is_level not in ("token", "sequence"):
            raise ValueError(f"is_level must be 'token' or 'sequence', got {self.is_level!r}")


def kl_per_token(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(p_theta || p_ref) from log-probs of the sampled tokens."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k3":
        log_r = ref_logprobs - logprobs
        return torch.exp(log_r) - log_r - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r} (expected 'k1' or 'k3')")


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], like: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape} ({like})")


def _sequence_index(mask: torch.Tensor, seq_ids: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Each token's sequence as an index into ``0..S-1`` over the whole batch, and ``S``: a
    sequence is a row, or with ``seq_ids`` (the sample of its row each token belongs to) one
    sample of a row."""
    rows = torch.arange(mask.shape[0], device=mask.device).unsqueeze(1).expand_as(mask)
    if seq_ids is None or mask.numel() == 0:
        return rows, mask.shape[0]
    key = rows * (int(seq_ids.max()) + 1) + seq_ids.long()
    uniq, index = torch.unique(key, return_inverse=True)
    return index, uniq.numel()


def _importance_weights(w: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, corrected)`` from raw importance weights ``w``: capped at ``is_cap`` (truncate)
    or zeroed outside ``[1/is_cap, is_cap]`` (mask); ``corrected`` marks the entries so treated."""
    if cfg.is_correction == "truncate":
        return torch.clamp(w, max=cfg.is_cap), w > cfg.is_cap
    corrected = (w > cfg.is_cap) | (w < 1.0 / cfg.is_cap)
    return torch.where(corrected, 0.0, w), corrected


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    config: LossConfig | None = None,
    seq_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss + k1 KL, token-summed over a constant normalizer.

    Shapes: ``logprobs``, ``old_logprobs``, ``ref_logprobs``, ``loss_mask`` are (B, T);
    ``advantages`` is (B,), or (B, T) per token (rows packing several sequences). ``seq_ids``
    (B, T), integers >= 0: for rows packing several sequences, which of its row's sequences each
    token belongs to (None: each row is one sequence); read for ``is_level = "sequence"`` and the
    ``sequences`` count. Returns the scalar loss and float stats.
    """
    cfg = config or LossConfig()
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {tuple(logprobs.shape)}")
    bt = tuple(logprobs.shape)
    _check_shape("old_logprobs", old_logprobs, bt, "same as logprobs")
    _check_shape("loss_mask", loss_mask, bt, "same as logprobs")
    if tuple(advantages.shape) != bt:  # else one per token
        _check_shape("advantages", advantages, bt[:1], "one per sequence of logprobs, or one per token")
    if ref_logprobs is not None:
        _check_shape("ref_logprobs", ref_logprobs, bt, "same as logprobs")
    elif cfg.kl_coef > 0:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logprobs, got None")
    if seq_ids is not None:
        _check_shape("seq_ids", seq_ids, bt, "same as logprobs: each token's sequence within its row")
        if seq_ids.dtype.is_floating_point or seq_ids.dtype == torch.bool or (
                seq_ids.numel() and int(seq_ids.min()) < 0):
            raise ValueError(f"seq_ids must be integers >= 0, got dtype {seq_ids.dtype}")

    mask = loss_mask.bool()
    maskf = mask.to(logprobs.dtype)
    tokens = int(mask.sum())
    normalizer = float(cfg.normalizer if cfg.normalizer is not None else bt[0] * bt[1])
    adv = advantages.detach().to(logprobs.dtype)
    adv = adv if adv.dim() == 2 else adv.unsqueeze(1)

    # where(), not multiply: padding may hold -inf log-probs, and exp(nan) * 0 is nan
    # in both the loss and its gradient. Unselected branches get exactly zero gradient.
    behaviour = old_logprobs.detach()
    # sampler vs trainer on the same tokens: log(p_sampler / p_trainer), whose mean is the k1
    # estimate of KL(sampler || trainer) (engine numerics, bf16, staleness)
    mismatch = torch.where(mask, behaviour - logprobs.detach(), 0.0)
    seq_index, n_seq = _sequence_index(mask, seq_ids)
    flat = seq_index.flatten()
    seq_tokens = torch.zeros(n_seq, device=mask.device).index_add_(0, flat, mask.flatten().float())
    sequences = int((seq_tokens > 0).sum())  # sequences with loss tokens
    weight = torch.ones_like(mismatch)
    n_corrected, units = 0, max(tokens, 1)  # is_corrected_fraction: tokens, or sequences
    if cfg.is_correction != "none":
        # decoupled: the ratio is taken to the trainer's own log-probs (the proximal policy:
        # the weights this update starts from), and the sampler's tokens are reweighted by
        # p_trainer / p_sampler, truncated at is_cap or, outside [1/is_cap, is_cap], dropped
        behaviour = logprobs.detach()
        if cfg.is_level == "token":
            weight, corrected = _importance_weights(torch.exp(-mismatch), cfg)
            corrected = corrected & mask
            n_corrected = int(corrected.sum())
        else:
            # one weight per sequence: the geometric mean of its tokens' ratios (mismatch is 0 off the mask)
            seq_mismatch = torch.zeros(n_seq, device=mask.device).index_add_(0, flat, mismatch.flatten().float())
            seq_weight, seq_corrected = _importance_weights(torch.exp(-seq_mismatch / seq_tokens.clamp(min=1)), cfg)
            seq_corrected = seq_corrected & (seq_tokens > 0)
            # where(): off the mask a sequence's weight may be inf (exp overflow), and inf * 0 is nan
            weight = torch.where(mask, seq_weight[seq_index].to(mismatch.dtype), 1.0)
            n_corrected, units = int(seq_corrected.sum()), max(sequences, 1)
    log_ratio = torch.where(mask, logprobs - behaviour, 0.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    # Pessimistic bound: once the ratio is past the bound in A's direction the clipped
    # (constant) term is the minimum and the token has no gradient, so a step cannot
    # push it further; moves back toward the old policy are never clipped.
    pg_tok = -weight * torch.minimum(ratio * adv, clipped * adv)
    pg_loss = (pg_tok * maskf).sum() / normalizer

    loss = pg_loss
    kl_mean = 0.0  # no reference given: KL not measured
    if ref_logprobs is not None:
        # Same -inf padding guard as above; the reference is frozen, hence detach.
        kl_tok = kl_per_token(
            torch.where(mask, logprobs, 0.0),
            torch.where(mask, ref_logprobs.detach(), 0.0),
            cfg.kl_estimator,
        )
        kl_sum = (kl_tok * maskf).sum()
        kl_mean = float(kl_sum.detach()) / max(tokens, 1)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_sum / normalizer

    with torch.no_grad():
        # Clipped = the branch that zeroes the gradient was taken.
        high = (ratio > 1.0 + cfg.clip_high) & (adv > 0)
        low = (ratio < 1.0 - cfg.clip_low) & (adv < 0)
        clip_fraction = float(((high | low) & mask).sum()) / max(tokens, 1)
        masked_ratio = ratio[mask]
        stats = {
            "loss": float(loss.detach()),
            "pg_loss": float(pg_loss.detach()),
            "kl": kl_mean,
            "clip_fraction": clip_fraction,
            "ratio_mean": float(masked_ratio.mean()) if tokens else 1.0,
            "ratio_max": float(masked_ratio.max()) if tokens else 1.0,
            "mismatch_kl": float(mismatch.sum()) / max(tokens, 1),
            "mismatch_max": float(mismatch[mask].abs().max()) if tokens else 0.0,
            "is_corrected_fraction": n_corrected / units,
            "tokens": float(tokens),
            "sequences": float(sequences),
        }
    return loss, stats


def _chunk_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float() / temperature  # log-softmax in fp32: bf16 log-probs are too coarse
    lse = torch.logsumexp(x, dim=-1)
    lp = x.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        logp = x - lse.unsqueeze(-1)
        p = logp.exp()
        # p = 0 where logits are -inf (masked vocab): 0 * -inf would be nan.
        ent = -torch.where(p > 0, p * logp, 0.0).sum(-1)
    return lp, ent


def token_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0, chunk_size: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target_ids[:, t]) under softmax(logits[:, t] / temperature), and the entropy.

    ``logits`` (B, T, V) must already be shifted so that ``logits[:, t]`` predicts
    ``target_ids[:, t]``. Use the sampler's temperature, or the importance ratio compares
    different distributions. Works on ``chunk_size`` positions at a time, and under
    autograd each chunk is checkpointed, so no fp32 (B, T, V) copy is kept for backward.
    The entropy (B, T) is for monitoring and carries no gradient.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    _check_shape("target_ids", target_ids, tuple(logits.shape[:2]), "logits' (B, T)")
    if target_ids.dtype.is_floating_point or target_ids.dtype == torch.bool:
        raise ValueError(f"target_ids must be integer token ids, got dtype {target_ids.dtype}")
    vocab = logits.shape[-1]
    if target_ids.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab):
        raise ValueError(
            f"target_ids out of range [0, {vocab}): min {int(target_ids.min())}, "
            f"max {int(target_ids.max())} (logits shape {tuple(logits.shape)})"
        )
    if not temperature > 0 or chunk_size < 1:
        raise ValueError(f"need temperature > 0, chunk_size >= 1; got {temperature}, {chunk_size}")

    use_ckpt = torch.is_grad_enabled() and logits.requires_grad
    lps, ents = [], []
    for start in range(0, logits.shape[1], chunk_size):
        chunk = logits[:, start : start + chunk_size]
        tgt = target_ids[:, start : start + chunk_size].long()
        if use_ckpt:
            lp, ent = checkpoint(_chunk_logprobs, chunk, tgt, temperature, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(chunk, tgt, temperature)
        lps.append(lp)
        ents.append(ent)
    if not lps:  # T == 0
        empty = logits.new_zeros(logits.shape[:2], dtype=torch.float32)
        return empty, empty.clone()
    return torch.cat(lps, dim=1), torch.cat(ents, dim=1)


def distill_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-position KL(teacher || student) over the vocabulary, (B, T); no gradient to the teacher.

    The targeted-feedback term (``rl/feedback.py``): the teacher is the same model shown a
    hint, so minimising this moves the student toward what it would do had it been told.
    Forward KL: its gradient on the student's logits is ``p_student - p_teacher``.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must have the same shape")
    s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    with torch.no_grad():
        t = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return (t.exp() * (t - s)).sum(-1)
