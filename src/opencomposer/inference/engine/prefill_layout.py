"""The prefill steps' host side: ``prefill_inputs`` (a step's token ids, positions, slots and
spans, for every prefill path); for the CUDA graphs, which steps a graph holds (token buckets
up to 4,096 tokens and ``PREFILL_GRAPH_SEQS`` sequences, capped by the step budget) and
``PrefillLayout``, where each graph input sits in the one int64 buffer a step's inputs travel in.

``ModelRunner`` captures and replays the graphs; this module is numpy and plain Python, so
the host work of a prefill step is tested and timed on the CPU
(``tests/unit/inference/test_prefill_host.py``, ``benchmarks/bench_prefill_host.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from opencomposer.inference.engine.block_manager import kv_slots

# prefill steps of at most this many tokens (and sequences) replay a CUDA graph (Triton path):
# 32-token buckets up to 256, then 64, 128 and 256 (padding costs at most ~15% of a step's work).
# Eager prefill is host-bound while a step's GPU work is short: ~1,000 tokens took ~12 ms for ~6 ms of
# GPU work (1.5B on an H100 box); a lockstep group of 8 agent turns (~1,700 tokens) ran eagerly too
PREFILL_GRAPH_TOKENS = (tuple(range(32, 257, 32)) + tuple(range(320, 513, 64)) + tuple(range(640, 1025, 128))
                        + tuple(range(1280, 4097, 256)))
PREFILL_GRAPH_SEQS = 16


def prefill_buckets(max_num_batched_tokens: int | None) -> tuple[int, ...]:
    """The prefill graphs' token buckets for a step budget: none larger than the first that
    holds the whole budget."""
    budget = max_num_batched_tokens or PREFILL_GRAPH_TOKENS[-1]
    return tuple(t for i, t in enumerate(PREFILL_GRAPH_TOKENS) if i == 0 or PREFILL_GRAPH_TOKENS[i - 1] < budget)


def bucket_of(tokens: int, seqs: int, buckets: tuple[int, ...] = PREFILL_GRAPH_TOKENS,
              max_seqs: int = PREFILL_GRAPH_SEQS) -> int | None:
    """The token bucket whose prefill graph holds a step of ``tokens`` tokens and ``seqs``
    sequences (None: no graph does)."""
    return None if seqs > max_seqs else next((t for t in buckets if t >= tokens), None)


def tiles_in_bucket(tokens: int, group: int, seqs: int = PREFILL_GRAPH_SEQS, rows: int | None = None) -> int:
    """Tiles a ``tokens`` bucket's graph launches (in tiles of ``rows``; by default the
    bucket's short-history tile, the most tiles): its tokens in one sequence, plus one partial
    tile per other sequence it may hold."""
    from opencomposer.inference.kernels.prefill import num_tiles

    return num_tiles(tokens, group, rows) + seqs


def bucket_variants(buckets: tuple[int, ...], group: int, kv_heads: int, head_dim: int, elem_bytes: int,
                    max_keys: int, sms: int) -> dict:
    """Bucket -> the (tile, key splits) its graphs are captured with (``triton_prefill.graph_variants``,
    each bucket's smallest step being one token more than the bucket below)."""
    from opencomposer.inference.kernels.prefill import graph_variants

    return {t: graph_variants(t, buckets[i - 1] if i else 0, group, kv_heads, head_dim, elem_bytes, max_keys, sms)
            for i, t in enumerate(buckets)}


class PrefillLayout:
    """Where each input of the prefill graphs sits in their one int64 buffer (``offsets``:
    name -> (start, size)), and the host side of a step: ``fill`` writes a step's inputs into
    views of a host array in that layout, which one copy then moves to the graph's buffer.

    Entries a step does not set keep the ``background``: padding tokens write the scratch
    block (and are token 0 at position 0), unused block-table rows are the scratch block,
    unused sequence rows are the padding sequence (no tokens, no work), and tiles past the
    step's are the padding sequence's (index ``seqs``): for graphs of the token buckets
    ``tokens`` and up to ``seqs`` sequences."""

    def __init__(self, max_blocks_per_seq: int, group: int, scratch_block: int, block_size: int,
                 tokens: tuple[int, ...] = PREFILL_GRAPH_TOKENS, seqs: int = PREFILL_GRAPH_SEQS):
        """Also makes ``host``: the host array ``fill`` writes (``host_tensor``: the same
        memory as a tensor, to copy from). It is kept (pageable): a copy from pageable memory
        has staged its source when ``copy_`` returns, so the next step may refill it; pinned
        memory would need an event per step to know that, which cost more than it saved."""
        s_max, w = seqs, max_blocks_per_seq
        t_max = max(tokens)
        self.max_tiles = max(tiles_in_bucket(t, group, s_max) for t in tokens)
        self.shapes = {"ids": (t_max,), "pos": (t_max,), "slots": (t_max,), "tables": (s_max + 1, w),
                       "seqs": (3, s_max + 1), "tiles": (2, self.max_tiles), "last": (s_max,)}
        self.offsets, o = {}, 0
        for name, shape in self.shapes.items():
            size = int(np.prod(shape))
            self.offsets[name] = (o, size)
            o += size
        self.total = o
        self.background = np.zeros(o, dtype=np.int64)
        v = self.views(self.background)
        v["slots"][:] = scratch_block * block_size
        v["tables"][:] = scratch_block
        v["tiles"][0] = s_max
        self.host = self.background.copy()
        self.host_tensor = torch.from_numpy(self.host)
        self._host_views = self.views(self.host)

    def views(self, buf):
        """Each input's view of ``buf`` (a host array or device tensor of ``total`` entries), in its shape."""
        return {name: buf[o:o + size].reshape(self.shapes[name]) for name, (o, size) in self.offsets.items()}

    def fill(self, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, last: list[int], tables: list[np.ndarray],
             seqs: list[list[int]], tiles: list[list[int]]) -> None:
        """Write a step into ``host``: the background, then the step's tokens, block tables,
        ``triton_prefill.plan``'s seqs and tiles, and the rows whose logits are kept."""
        n, v = len(ids), self._host_views
        np.copyto(self.host, self.background)
        v["ids"][:n], v["pos"][:n], v["slots"][:n] = ids, pos, slots
        for row, table in zip(v["tables"], tables):
            row[:len(table)] = table
        v["seqs"][:, :len(seqs[0])] = seqs
        v["tiles"][:, :len(tiles[0])] = tiles
        v["last"][:len(last)] = last


def prefill_inputs(batch, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int], list[tuple]]:
    """A prefill step's (``ScheduledBatch``) token ids, positions and KV slots (int64 arrays),
    the row of each sampling sequence's last token, and per sequence ``(start row, new tokens, cached tokens, block
    table up to its last token as an int64 array)``: what both prefill paths feed the model.
    Built with numpy per sequence, not per token (a turn's ~200 new tokens cost ~30 us as
    Python lists)."""
    ids, pos, slots, last, spans = [], [], [], [], []
    bs = block_size
    start = 0
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.chunks)):
        c = seq.num_computed
        table = np.fromiter(seq.block_table, np.int64, -(-(c + n) // bs))  # its first blocks, up to token c + n
        p = np.arange(c, c + n, dtype=np.int64)
        ids.append(np.fromiter(seq.token_ids[c:c + n], np.int64, n))
        pos.append(p)
        slots.append(kv_slots(table, p, bs))
        spans.append((start, n, c, table))
        start += n
        if batch.samples(i):
            last.append(start - 1)
    return _cat(ids), _cat(pos), _cat(slots), last, spans


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
