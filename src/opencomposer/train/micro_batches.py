"""Samples -> micro-batches of at most ``micro_batch_tokens`` tokens, as tensors for one forward.

    groups = group_samples(samples, budget=8192, packed=True)
    batch = collate(groups[0], pad_id, device, packed=True)

Packed (the default, ``[train] pack_sequences``): the samples of a group are laid end to end in
one row, ``position_ids`` restarting at 0 for each, and the model attends within each sample
only (``train/document_attention.py``); no token is padding. Padded: one right-padded row per
sample, rows x longest row <= budget, which wastes the difference in lengths and, in attention,
the square of it. Either way a sample longer than the budget goes alone.

Per-token fields (targets, loss mask, old log-probs, advantages) are kept only at output
positions that predict a loss token of some row (``keep``): prompts and tool outputs are most
of an agent sequence, and the vocabulary-wide head dominates a step's cost. Output position t
predicts token t + 1, and a packed sample's first token is never a loss token
(``Sample.loss_mask[0]`` is 0), so no position predicts across a document boundary.

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
    tokens: float  # real (unpadded) tokens
    routes: torch.Tensor | None = None  # MoE: (rows, width, sparse layers, k) recorded experts, -1 = free

    @property
    def packed(self) -> bool:
        return self.positions is not None


def group_samples(samples: list[Sample], budget: int, packed: bool) -> list[list[Sample]]:
    """Longest first; packed: first fit by total tokens, padded: rows x longest row <= budget."""
    order = sorted(samples, key=len, reverse=True)  # similar lengths together: less padding
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
        i = next((i for i, r in enumerate(room) if len(s) <= r), None)
        if i is None:
            groups.append([s])
            room.append(budget - len(s))
        else:
            groups[i].append(s)
            room[i] -= len(s)
    return groups


def collate(batch: list[Sample], pad_id: int, device: torch.device, packed: bool) -> Batch:
    """``batch`` as one packed row or as right-padded rows, on ``device``."""
    if packed:
        ids = torch.tensor([t for s in batch for t in s.input_ids], dtype=torch.long)[None]
        mask = torch.tensor([m for s in batch for m in s.loss_mask], dtype=torch.float32)[None]
        old = torch.tensor([x for s in batch for x in s.old_logprobs], dtype=torch.float32)[None]
        adv = torch.tensor([s.advantage for s in batch for _ in s.input_ids], dtype=torch.float32)[None]
        pos = torch.cat([torch.arange(len(s)) for s in batch])[None]
        attn = None
        routes = _packed_routes(batch)
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
        pos = None
        routes = pad_routes([s.routes for s in batch], width)
    keep = (mask[:, 1:].sum(0) > 0).nonzero().squeeze(1)
    at = keep + 1

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return Batch(ids.to(device), dev(attn), dev(pos), keep.to(device), ids[:, at].to(device), mask[:, at].to(device),
                 old[:, at].to(device), adv[:, at].contiguous().to(device), float(sum(len(s) for s in batch)),
                 dev(routes))


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
