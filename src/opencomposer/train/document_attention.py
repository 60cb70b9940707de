"""Attention within each document of a packed row: several samples share one row of a
micro-batch (no padding), and no token sees another sample's tokens.

    with document_attention(model):
        out = model(input_ids=ids, position_ids=pos, use_cache=False)   # pos restarts at 0 per document

A document starts wherever ``position_ids`` is 0 (so RoPE sees every document from position 0,
as if alone). A piece that starts at a position q > 0 (where the positions do not go on by one)
is the rest of a document whose first q tokens are those of the row's last document that
started at 0 (``micro_batches``' shared prefixes): its queries attend to those q keys and
values, then causally to its own, as they would in the whole document. Inside the context the
model's attention is this module's function, registered with transformers' ``AttentionInterface``:
it runs SDPA with ``is_causal`` on each document's
slice of the queries, keys and values, so the cost is the sum of the documents' squared lengths
(a block-diagonal mask over the whole row would cost the row's squared length, and on the CPU
there is no flash-attn varlen kernel). No mask is built: transformers skips mask creation
for attention functions it has no mask function for. Outside the context the model is as before
(generation keeps its padded, cached attention).

Test: ``pytest tests/unit/train/test_packing.py``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
import torch.nn.functional as F

NAME = "opencomposer_documents"
_registered = False


def document_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  position_ids: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: (batch, heads, tokens, dim) in, (batch, tokens, heads, dim) out."""
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        raise ValueError("document attention needs position_ids, no attention mask and no cache "
                         "(one packed row per forward, as the trainer builds it)")
    gqa = query.shape[1] != key.shape[1]
    rows = []
    for b in range(query.shape[0]):
        bounds, firsts = _layout(position_ids, b if position_ids.shape[0] > 1 else 0)
        root = 0  # where the last document starting at position 0 starts in the row
        pieces = []
        for s, e, first in zip(bounds, bounds[1:], firsts):
            q, k, v = query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e]
            if first == 0:
                root = s
                pieces.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                             scale=scaling, enable_gqa=gqa))
                continue
            if root + first > s:
                raise ValueError(f"document attention: a piece at row position {s} goes on from position {first}, "
                                 f"but the document it shares a prefix with has only {s - root} tokens")
            k = torch.cat([key[b:b + 1, :, root:root + first], k], dim=2)
            v = torch.cat([value[b:b + 1, :, root:root + first], v], dim=2)
            # causal aligned to the bottom right: query i sees the shared prefix and its own 0..i
            allowed = torch.ones(e - s, first + e - s, dtype=torch.bool, device=q.device).tril(diagonal=first)
            pieces.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout,
                                                         scale=scaling, enable_gqa=gqa))
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


# id(position_ids) -> each row's (bounds, firsts): every layer of a forward (and its recomputation
# in backward) gets the same position_ids tensor, so its layout is read off it once, not once a
# layer (on a GPU each read is a device-to-host sync). An entry goes when its tensor does, so a
# later tensor at the same address never meets it.
_layouts: dict[int, dict[int, tuple[list[int], list[int]]]] = {}


def _layout(position_ids: torch.Tensor, row: int) -> tuple[list[int], list[int]]:
    """Where row ``row``'s pieces start and end (``bounds``) and each piece's first position."""
    key = id(position_ids)
    rows = _layouts.get(key)
    if rows is None:
        rows = _layouts[key] = {}
        weakref.finalize(position_ids, _layouts.pop, key, None)
    if row not in rows:
        pos = position_ids[row]
        breaks = ((pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1).tolist()
        bounds = [0, *breaks, pos.shape[0]]
        rows[row] = (bounds, pos[bounds[:-1]].tolist())
    return rows[row]


@contextlib.contextmanager
def document_attention(model: Any) -> Iterator[None]:
    """Within, ``model`` attends per document of each row (see the module docstring)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, document_sdpa)
        _registered = True
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
