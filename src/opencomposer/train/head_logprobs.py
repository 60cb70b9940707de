"""Token log-probs through the output layer, a chunk of tokens at a time: the [tokens, vocab]
logits never exist in fp32 all at once, neither in the forward nor in the backward.

    lp, ent = head_token_logprobs(hidden, lm_head.weight, None, targets, temperature=0.7, chunk_tokens=1024)
    (-(lp * mask).sum() / n).backward()       # SFT's NLL; RL feeds lp to grpo_loss

``hidden`` (..., H) are the final hidden states at the positions that predict ``targets`` (...);
returns ``log softmax(hidden @ weight.T + bias) / temperature)[target]`` and the entropy of that
distribution (for monitoring, no gradient), both fp32 of ``targets``' shape. A custom autograd
function keeps only ``hidden``, the weight and one log-sum-exp a token for backward, and recomputes
each chunk's logits there: for 8k tokens of a 49k vocabulary that replaces several 1.6 GB fp32
tensors (logits, log-softmax, their gradients) by one chunk's 0.2 GB (issue 32). The matmuls
run in ``dtype`` (bf16 under autocast, as ``lm_head`` would); the softmax always in fp32.

Test: ``pytest tests/unit/train/test_head_logprobs.py``.
"""

from __future__ import annotations

import torch

__all__ = ["head_token_logprobs"]


def head_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    temperature: float = 1.0, chunk_tokens: int = 1024, entropy: bool = True, dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) of ``targets`` under the output layer ``weight`` (V, H) on ``hidden``."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)}: expected (..., H) and (...)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)}: expected (vocab, {hidden.shape[-1]})")
    if not temperature > 0 or chunk_tokens < 1:
        raise ValueError(f"need temperature > 0, chunk_tokens >= 1; got {temperature}, {chunk_tokens}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= weight.shape[0]):
        raise ValueError(f"targets out of range [0, {weight.shape[0]}): min {int(targets.min())}, max {int(targets.max())}")
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1).long()
    lp, ent = _HeadLogprobs.apply(flat_h, weight, bias, flat_t, float(temperature), int(chunk_tokens),
                                  bool(entropy), dtype or weight.dtype)
    return lp.view(targets.shape), ent.view(targets.shape)


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """One chunk's fp32 logits / temperature; ``w``/``b`` are already in the matmul dtype."""
    x = (h.to(w.dtype) @ w.T if b is None else torch.addmm(b, h.to(w.dtype), w.T)).float()
    return x.div_(temperature) if temperature != 1.0 else x


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy, dtype):  # type: ignore[override]
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            n = hidden.shape[0]
            lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
            lse = torch.empty_like(lp)
            ent = torch.zeros_like(lp)
            for s in range(0, n, chunk):
                x = _logits(hidden[s:s + chunk], w, b, temperature)
                z = torch.logsumexp(x, dim=-1)
                lp[s:s + chunk] = x.gather(-1, targets[s:s + chunk, None])[:, 0] - z
                lse[s:s + chunk] = z
                if with_entropy:  # H = lse - sum p x
                    ent[s:s + chunk] = z - (x - z[:, None]).exp_().mul_(x).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        t, chunk, dtype = ctx.temperature, ctx.chunk, ctx.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            gh = torch.empty_like(hidden) if need_h else None
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
            grad_lp = grad_lp.float()
            for s in range(0, hidden.shape[0], chunk):
                g = grad_lp[s:s + chunk, None]
                # d lp / d x = onehot(target) - softmax(x); x = logits / t
                dx = _logits(hidden[s:s + chunk], w, b, t).sub_(lse[s:s + chunk, None]).exp_().mul_(-g)
                dx.scatter_add_(-1, targets[s:s + chunk, None], g)
                if t != 1.0:
                    dx.div_(t)
                dx = dx.to(dtype)
                if gh is not None:
                    gh[s:s + chunk] = (dx @ w).to(hidden.dtype)
                if gw is not None:
                    gw.add_(dx.T @ hidden[s:s + chunk].to(dtype))
                if gb is not None:
                    gb.add_(dx.sum(0))
        return (gh, None if gw is None else gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype),
                None, None, None, None, None)
