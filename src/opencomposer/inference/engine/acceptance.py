"""Which drafted tokens a speculative decoding step keeps: rejection sampling on the device,
for every sequence of the step at once (Leviathan et al. 2023; Chen et al. 2023), so a CUDA
graph can hold it. ``Speculator`` (``speculate.py``) runs it eagerly, ``SpecGraphs``
(``spec_graph.py``) inside a graph.

    view = logits[row_index(starts, lens, k)]             # [B, k + 1, V]
    n_keep, tokens, logprobs, lse = accept(view, drafts, lens, temps, greedy, params, q, u)

Test: ``pytest tests/unit/inference/test_speculate.py``.
"""

from __future__ import annotations

import torch

from opencomposer.inference.engine.sampler import draw, truncate


def row_index(starts: torch.Tensor, lens: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k + 1] rows of each sequence's last sampled token and drafts (``starts[i]`` on;
    ``lens[i]`` drafts): past a sequence's drafts its last row repeats."""
    cols = torch.arange(k + 1, device=starts.device)
    return starts[:, None] + torch.minimum(cols[None, :], lens[:, None])


def accept(view: torch.Tensor, d: torch.Tensor, lens: torch.Tensor, temps: torch.Tensor, greedy: torch.Tensor,
           params: list | None, q: torch.Tensor | None, u: torch.Tensor | None, pick=draw):
    """Every sequence's accept / reject at once, on the device (a graph can hold it).
    ``view`` [B, K + 1, V]: the model's logits at each sequence's last sampled token and its
    drafts ``d`` [B, K] (``lens`` [B] of them; rows after repeat the last). ``q`` [B, K, V]:
    the drafts' distributions and ``u`` [B, 2K + 1] uniforms (both None when every row is
    greedy); ``params``: rows' top-k / top-p (None: all plain); ``pick``: how a row's token
    is drawn from its weights (``sampler.draw`` with the row's uniform, or ``sampler.race``).
    Returns kept drafts per sequence [B], its new tokens [B, K + 1] (kept drafts, then the
    sampled one; padding after), their logprobs [B, K + 1] (``log_softmax(logits / T)``,
    before top-k / top-p, as ``sampler.py`` reports), and every row's log normaliser
    [B, K + 1, 1] (``logits / T - it`` are the row's logprobs)."""
    b, k1, vocab = view.shape
    k = k1 - 1
    cols = torch.arange(k1, device=view.device)
    scaled = view / temps[:, None, None]
    lse = scaled.logsumexp(-1, keepdim=True)  # (a reduction over many blocks: no row-wide softmax kernel)
    valid = cols[None, :k] < lens[:, None]
    picks = view.argmax(-1)
    keep = (picks[:, :k] == d) & valid
    if q is not None:
        logprobs = scaled - lse
        lp = truncate(logprobs.reshape(-1, vocab), [x for x in params for _ in range(k1)]) if params else logprobs
        p = lp.exp().view(b, k1, vocab)
        at = (torch.arange(b, device=view.device)[:, None], cols[None, :k], d)
        kept_s = (u[:, :k] * q[at] < p[at]) & valid  # keep with probability min(1, p / q)
        residual = torch.cat([(p[:, :k] - q).clamp_(min=0), p[:, k:]], 1)  # a rejection's; the bonus row's p
        empty = residual.sum(-1, keepdim=True) <= 0  # p == q there: no rejection can happen
        drawn = pick(torch.where(empty, p, residual).view(-1, vocab), u[:, k:].reshape(-1)).view(b, k1)
        picks = torch.where(greedy[:, None], picks, drawn)
        keep = torch.where(greedy[:, None], keep, kept_s)
    n_keep = keep.long().cumprod(1).sum(1)
    padded = torch.cat([d, d.new_zeros(b, 1)], 1)
    tokens = torch.where(cols[None, :] < n_keep[:, None], padded, picks)
    return n_keep, tokens, scaled.gather(2, tokens[..., None])[..., 0] - lse[..., 0], lse
