"""Samples -> micro-batches of at most ``micro_batch_tokens`` tokens, as tensors for one forward.

    groups = group_samples(samples, budget=8192, packed=True)
    batch = collate(groups[0], pad_id, device, packed=True)

Packed (the default, ``[train] pack_sequences``): the samples of a group are laid end to end in
one row, ``position_ids`` restarting at 0 for each, and the model attends within each sample
only (``train/document_attention.py``); no token is padding. Padded: one right-padded row per
sample, rows x longest row <= budget, which wastes the difference in lengths and, in attention,
the square of it. Either way a sample longer than the budget goes alone.

Shared prefixes (``[train] share_prefixes``, packed rows only): samples of one harness share
their first ~1.1k tokens (system prompt and tool schemas), and a GRPO group shares its whole
first prompt. A row holds its first sample (the root) whole; each later sample that begins
with tokens the root also begins with is laid down without them, its ``position_ids`` going
on from where the shared tokens end, and attends to the root's copy of them
(``document_attention``). The result is exact: causal attention means the shared tokens'
states do not depend on what follows them, and gradients through them add up over the samples
that use them as they would over separate copies. A prefix is shared only up to the token
before a sample's first loss token (so every loss token is predicted from within its own
piece of the row), and never for samples with recorded MoE routes (each copy's routes would
have to agree: a batch with any routes shares nothing). ``group_samples`` counts a sample at
its unshared length against the budget.
``Batch.tokens`` still counts every sample's whole length: the tokens trained on, as without
sharing (``Batch.computed`` is what the forward ran).

Per-token fields (targets, loss mask, old log-probs, advantages) are kept only at output
positions that predict a loss token of some row (``keep``): prompts and tool outputs are most
of an agent sequence, and the vocabulary-wide head dominates a step's cost. Output position t
predicts token t + 1, and a packed sample's first token is never a loss token
(``Sample.loss_mask[0]`` is 0; a shared prefix ends before the token preceding the first loss
token), so no position predicts across a document boundary.

Test: ``pytest tests/unit/train/test_packing.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opencomposer.models.moe_replay import NO_ROUTE, pad_routes
from opencomposer.train.samples import Sample


@dataclass
class Batch:
    """One micro-batch; per-token fields are (rows, len(keep)), at the kept positions."""

    ids: torch.Tensor
    attn: torch.Tensor | None  # padded rows' attention mask; None when packed (documents by position_ids)
    positions: torch.Tensor | None  # packed: position of each token within its sample
    keep: torch.Tensor  # output positions whose next token is a loss token in some row
    targets: torch.Tensor
    mask: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor  # per kept token: its sample's advantage
    tokens: float  # real (unpadded) tokens of the samples, shared prefixes counted in each
    routes: torch.Tensor | None = None  # MoE: (rows, width, sparse layers, k) recorded experts, -1 = free
    computed: float = 0.0  # tokens the forward runs: ``tokens`` less the shared prefixes laid down once
    seq: torch.Tensor | None = None  # packed: per kept token, the sample of the row it belongs to; padded: None

    @property
    def packed(self) -> bool:
        return self.positions is not None


def shared_length(root: Sample, s: Sample) -> int:
    """How many leading tokens ``s`` can take from ``root`` in a packed row: their common prefix,
    cut before the token that precedes ``s``'s first loss token; 0 where either has MoE routes."""
    if root.routes is not None or s.routes is not None:
        return 0
    first_loss = next((i for i, m in enumerate(s.loss_mask) if m), len(s))
    limit = min(len(root), first_loss - 1)
    n = 0
    a, b = root.input_ids, s.input_ids
    while n < limit and a[n] == b[n]:
        n += 1
    return max(n, 0)


def group_samples(samples: list[Sample], budget: int, packed: bool, share: bool = False) -> list[list[Sample]]:
    """Longest first; packed: first fit by total tokens (``share``: less the prefix each shares
    with its row's first sample), padded: rows x longest row <= budget."""
    order = sorted(samples, key=len, reverse=True)  # similar lengths together: less padding
    share = share and _shareable(samples)
    groups: list[list[Sample]] = []
    if not packed:
        for s in order:
            if groups and (len(groups[-1]) + 1) * len(groups[-1][0]) <= budget:
                groups[-1].append(s)
            else:
                groups.append([s])
        return groups
    room: list[int] = []
    for s in order:
        costs = ((i, len(s) - (shared_length(g[0], s) if share else 0)) for i, g in enumerate(groups))
        i, cost = next(((i, c) for i, c in costs if c <= room[i]), (None, 0))
        if i is None:
            groups.append([s])
            room.append(budget - len(s))
        else:
            room[i] -= cost
            groups[i].append(s)
    return groups


def collate(batch: list[Sample], pad_id: int, device: torch.device, packed: bool, share: bool = False) -> Batch:
    """``batch`` as one packed row (``share``: later samples without the prefix they share with
    the first) or as right-padded rows, on ``device``."""
    if packed:
        batch, cut = _shared_order(batch) if share and _shareable(batch) else (batch, [0] * len(batch))
        ids = torch.tensor([t for s, c in zip(batch, cut) for t in s.input_ids[c:]], dtype=torch.long)[None]
        mask = torch.tensor([m for s, c in zip(batch, cut) for m in s.loss_mask[c:]], dtype=torch.float32)[None]
        old = torch.tensor([x for s, c in zip(batch, cut) for x in s.old_logprobs[c:]], dtype=torch.float32)[None]
        adv = torch.tensor([s.advantage for s, c in zip(batch, cut) for _ in s.input_ids[c:]], dtype=torch.float32)[None]
        pos = torch.cat([torch.arange(c, len(s)) for s, c in zip(batch, cut)])[None]
        seq = torch.tensor([i for i, (s, c) in enumerate(zip(batch, cut)) for _ in s.input_ids[c:]])[None]
        attn = None
        routes = _packed_routes(batch)  # None, or nothing was shared
    else:
        rows, width = len(batch), max(len(s) for s in batch)
        ids = torch.full((rows, width), pad_id, dtype=torch.long)
        attn = torch.zeros((rows, width), dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.float32)
        old = torch.zeros((rows, width), dtype=torch.float32)
        for i, s in enumerate(batch):
            n = len(s)
            ids[i, :n] = torch.tensor(s.input_ids)
            attn[i, :n] = 1
            mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
            old[i, :n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
        adv = torch.tensor([s.advantage for s in batch], dtype=torch.float32)[:, None].expand(rows, width)
        pos = seq = None  # one sample a row
        routes = pad_routes([s.routes for s in batch], width)
    keep = (mask[:, 1:].sum(0) > 0).nonzero().squeeze(1)
    at = keep + 1

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return Batch(ids.to(device), dev(attn), dev(pos), keep.to(device), ids[:, at].to(device), mask[:, at].to(device),
                 old[:, at].to(device), adv[:, at].contiguous().to(device), float(sum(len(s) for s in batch)),
                 dev(routes), float(ids.shape[1]) if packed else float(ids.numel()),
                 None if seq is None else seq[:, at].to(device))


def _shareable(samples: list[Sample]) -> bool:
    """No recorded MoE routes: ``_packed_routes`` lays every routed sample down whole."""
    return all(s.routes is None for s in samples)


def _shared_order(batch: list[Sample]) -> tuple[list[Sample], list[int]]:
    """The row's samples and how many leading tokens each takes from the first: the first, then
    those sharing a prefix with it, then the rest (a piece starting at position 0 would become the
    root that later pieces read). A piece whose first position would go on by one from the piece
    before it (and so read as its continuation) shares one token less."""
    cuts = [0] + [shared_length(batch[0], s) for s in batch[1:]]
    idx = [0] + [i for i in range(1, len(batch)) if cuts[i]] + [i for i in range(1, len(batch)) if not cuts[i]]
    order, cuts = [batch[i] for i in idx], [cuts[i] for i in idx]
    for i in range(2, len(order)):
        if cuts[i] and cuts[i - 1] and cuts[i] == len(order[i - 1]):
            cuts[i] -= 1  # >= 1: the piece before started at >= 1, so it is >= 2 long
    return order, cuts


def _packed_routes(batch: list[Sample]) -> torch.Tensor | None:
    """The samples' recorded routes end to end, -1 (free) where a sample has none and at each
    sample's last token (the sampler never ran it)."""
    known = [s.routes for s in batch if s.routes is not None]
    if not known:
        return None
    rows = [pad_routes([s.routes if s.routes is not None else None], len(s)) for s in batch]
    shape = known[0].shape[1:]
    return torch.cat([r[0] if r is not None else torch.full((len(s), *shape), NO_ROUTE, dtype=torch.long)
                      for r, s in zip(rows, batch)])[None]
