"""Attention within each document of a packed row: several samples share one row of a
micro-batch (no padding), and no token sees another sample's tokens.

    kind = attention_kind(cfg.document_attention, device)   # [train] document_attention: "sdpa" or "flex"
    with document_attention(model, kind):
        out = model(input_ids=ids, position_ids=pos, use_cache=False)   # pos restarts at 0 per document

A document starts wherever ``position_ids`` is 0 (so RoPE sees every document from position 0,
as if alone). A piece that starts at a position q > 0 (where the positions do not go on by one)
is the rest of a document whose first q tokens are those of the row's last document that
started at 0 (``micro_batches``' shared prefixes): its queries attend to those q keys and
values, then causally to its own, as they would in the whole document. Inside the context the
model's attention is one of this module's functions, registered with transformers'
``AttentionInterface``; both read the row's pieces off ``position_ids`` (``_layout``):

- ``document_sdpa`` (the CPU's, and the reference): SDPA with ``is_causal`` on each document's
  slice of the queries, keys and values, so the cost is the sum of the documents' squared lengths
  (a block-diagonal mask over the whole row would cost the row's squared length, and on the CPU
  there is no flash-attn varlen kernel). A shared-prefix piece needs an explicit mask, which on
  CUDA rules out the flash kernel; and on a GPU the loop's many small launches dominate.
- ``document_flex`` (CUDA's where rows hold shared prefixes): one compiled FlexAttention call over
  the whole row, whose mask (``_block_mask``: same piece and not after the query, or inside the
  query's shared prefix) is built once a forward; the fused kernel skips the 128 x 128 blocks that
  no query attends.

No mask is built by transformers: it skips mask creation for attention functions it has no mask
function for. Outside the context the model is as before (generation keeps its padded, cached
attention).

Test: ``pytest tests/unit/train/test_packing.py tests/unit/train/test_document_attention.py``;
on a GPU also ``tests/gpu/test_document_attention_cuda.py``.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

NAME = "opencomposer_documents"
FLEX_NAME = "opencomposer_documents_flex"
_registered = False

# (start, end, root, first): tokens start..end-1 attend causally among themselves and to the
# ``first`` tokens from ``root`` on (a shared prefix; first == 0: none)
Piece = tuple[int, int, int, int]


def document_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  position_ids: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: (batch, heads, tokens, dim) in, (batch, tokens, heads, dim) out."""
    gqa = _check(query, key, attention_mask, position_ids)
    rows = []
    for b in range(query.shape[0]):
        pieces = []
        for s, e, root, first in _layout(position_ids, b):
            q, k, v = query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e]
            if first == 0:
                pieces.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                             scale=scaling, enable_gqa=gqa))
                continue
            k = torch.cat([key[b:b + 1, :, root:root + first], k], dim=2)
            v = torch.cat([value[b:b + 1, :, root:root + first], v], dim=2)
            # causal aligned to the bottom right: query i sees the shared prefix and its own 0..i
            allowed = torch.ones(e - s, first + e - s, dtype=torch.bool, device=q.device).tril(diagonal=first)
            pieces.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout,
                                                         scale=scaling, enable_gqa=gqa))
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def document_flex(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  position_ids: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """``document_sdpa``'s attention as one FlexAttention call (compiled: eager flex attention
    materialises the whole row's scores)."""
    gqa = _check(query, key, attention_mask, position_ids)
    if dropout:
        raise ValueError(f"flex document attention has no dropout (the model asks for {dropout}); "
                         'use [train] document_attention = "sdpa"')
    mask = _block_mask(position_ids, query.shape[0], query.shape[2], query.device)
    out = _compiled_flex()(query, key, value, block_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def _check(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
           position_ids: torch.Tensor | None) -> bool:
    """Refuses what document attention cannot take; whether the keys have fewer heads (GQA)."""
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        raise ValueError("document attention needs position_ids, no attention mask and no cache "
                         "(one packed row per forward, as the trainer builds it)")
    return query.shape[1] != key.shape[1]


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


# id(position_ids) -> what is read off it: every layer of a forward (and its recomputation in
# backward) gets the same position_ids tensor, so each row's layout is read once, not once a
# layer (on a GPU each read is a device-to-host sync), and so is flex attention's block mask.
# An entry goes when its tensor does, so a later tensor at the same address never meets it.
_layouts: dict[int, dict[int, list[Piece]]] = {}
_block_masks: dict[int, Any] = {}


def _per_tensor(cache: dict[int, Any], position_ids: torch.Tensor, make: Callable[[], Any]) -> Any:
    key = id(position_ids)
    if key not in cache:
        cache[key] = make()
        weakref.finalize(position_ids, cache.pop, key, None)
    return cache[key]


def _layout(position_ids: torch.Tensor, row: int) -> list[Piece]:
    """Row ``row``'s pieces, in order (``Piece``; one row of positions serves every row); a shared
    prefix is the row's last document that started at position 0."""
    row = row if position_ids.shape[0] > 1 else 0
    rows = _per_tensor(_layouts, position_ids, dict)
    if row not in rows:
        pos = position_ids[row]
        breaks = ((pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1).tolist()
        bounds = [0, *breaks, pos.shape[0]]
        pieces, root = [], 0
        for s, e, first in zip(bounds, bounds[1:], pos[bounds[:-1]].tolist()):
            if first == 0:
                root = s
            elif root + first > s:
                raise ValueError(f"document attention: a piece at row position {s} goes on from position {first}, "
                                 f"but the document it shares a prefix with has only {s - root} tokens")
            pieces.append((s, e, root, first))
        rows[row] = pieces
    return rows[row]


def _block_mask(position_ids: torch.Tensor, rows: int, length: int, device: torch.device) -> Any:
    """Flex attention's mask of ``rows`` rows of ``length`` tokens (``document_sdpa``'s, as one mask)."""
    def make() -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        pieces = torch.tensor([p for b in range(rows) for p in _layout(position_ids, b)], dtype=torch.int32)
        # each token's piece start, shared-prefix start and end (an empty prefix: start == end)
        per_token = pieces.repeat_interleave(pieces[:, 1] - pieces[:, 0], dim=0).view(rows, length, 4)
        start, root, first = (per_token[..., i].contiguous().to(device) for i in (0, 2, 3))
        end = root + first

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return ((kv >= start[b, q]) & (kv <= q)) | ((kv >= root[b, q]) & (kv < end[b, q]))

        return create_block_mask(mask_mod, rows, None, length, length, device=device)

    return _per_tensor(_block_masks, position_ids, make)


def attention_kind(setting: str, device: torch.device, shared_prefixes: bool = True) -> str:
    """``[train] document_attention`` on ``device``: "flex" or "sdpa". "auto" is flex where it runs
    and rows hold shared-prefix pieces (RL groups: 3.1x the SDPA loop on one H200 at the 1.5B shape),
    else sdpa (rows of whole documents: one flash-attention call each, 1.25x flex on dense rows)."""
    missing = _flex_missing(device)
    if setting == "flex" and missing:
        raise ValueError(f'[train] document_attention = "flex": {missing}; FlexAttention\'s fused kernels need '
                         'a CUDA device and triton (use "auto" or "sdpa")')
    if setting == "auto":
        return "flex" if shared_prefixes and not missing else "sdpa"
    return setting


def _flex_missing(device: torch.device) -> str | None:
    """Why flex attention cannot run on ``device``; None where it can."""
    if device.type != "cuda":
        return f"the model is on {device}, not a CUDA device"
    try:
        import triton  # noqa: F401
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError as e:
        return f"it does not import ({e})"
    return None


@contextlib.contextmanager
def document_attention(model: Any, kind: str = "sdpa") -> Iterator[None]:
    """Within, ``model`` attends per document of each row (see the module docstring) with
    ``kind``'s function: "sdpa" or "flex" (``attention_kind``)."""
    global _registered
    if kind not in ("sdpa", "flex"):
        raise ValueError(f"document attention {kind!r}: expected 'sdpa' or 'flex' (attention_kind resolves 'auto')")
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, document_sdpa)
        AttentionInterface.register(FLEX_NAME, document_flex)
        _registered = True
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME if kind == "sdpa" else FLEX_NAME
    try:
        yield
    finally:
        config._attn_implementation = before
