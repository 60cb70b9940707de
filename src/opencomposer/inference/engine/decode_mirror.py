"""The CPU decode path's contiguous copy of each decoding sequence's K/V.

On a GPU, decode attention reads the paged cache in place (``triton_kernels.paged_decode``).
The portable torch path (``attention._decode``) must gather every sequence's blocks into one
tensor before SDPA -- every layer of every step. On the CPU that copy is most of attention's
cost: SmolLM2-135M at batch 8 on ~1,400-token contexts (2-core VM) spent ~48 ms of a ~250 ms
step in the gathers, and SDPA read their transposed result slower than contiguous K/V.

``DecodeMirror`` keeps, for each sequence being decoded, its K/V contiguous and head-major:
per layer ``[slot, kv_head, position, head_dim]``, the form SDPA reads directly. A decode
step appends one token per sequence; a sequence is copied from the paged cache only when it
joins decoding (after its prefill, or again after preemption). The paged cache stays the
source of truth: prefill, prefix caching and preemption read and write only it, and every
decode step still writes its new K/V there too.

Slots ``0 .. n-1`` hold the step's ``n`` sequences (a sequence that leaves decoding hands its
slot to the one in the last slot), so one SDPA call covers the batch; its rows are put in slot
order and back. Memory: every slot has room for the longest context (in steps of ``GROW``
positions), at most ``budget`` bytes -- the runner gives the paged cache's size; a step that
would need more (many long sequences at once) decodes through the gathers, as on any device
without the mirror.

Test: ``pytest tests/unit/inference/test_decode_mirror.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opencomposer.inference.models.attention import length_mask

GROW = 256  # capacity in positions is a multiple of this


@dataclass
class MirrorView:
    """One decode step's use of the mirror (``AttentionBatch.mirror``)."""

    k: torch.Tensor        # [L, slots, kv_heads, cap, d]: every layer's keys (the mirror's own)
    v: torch.Tensor
    slot: torch.Tensor     # [B] int64: the slot of each batch row
    pos: torch.Tensor      # [B] int64: where each row's new token goes (its context length - 1)
    order: torch.Tensor | None  # [n] int64: the batch row in each slot (None: slot i is row i)
    mask: torch.Tensor     # [n, 1, 1, W] additive: 0 for each slot's context, -inf after it
    width: int             # W: the longest context of the step


class DecodeMirror:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, max_len: int,
                 budget: int):
        """``budget``: bytes the mirror may take (the runner gives the paged cache's own size); a
        step whose sequences would need more decodes through the block gathers instead."""
        self.shape = (num_layers, kv_heads, head_dim)
        self.dtype, self.max_len, self.budget = dtype, max_len, budget
        self._clear()

    def forget(self, seqs) -> None:
        """Drop these sequences (a prefill step recomputes their K/V: the copy may be stale)."""
        for s in seqs:
            if s in self.slots:
                self._release(s)

    def step(self, seqs: list, k_cache: torch.Tensor, v_cache: torch.Tensor) -> MirrorView | None:
        """Make the slots hold each of ``seqs`` up to (not including) its newest token, whose
        K/V this step computes; ``k_cache``/``v_cache`` [L, blocks, block_size, kv_heads, d]
        are the paged caches it copies joining sequences from. None (and nothing held) if the
        step's slots would take more than the budget."""
        members = set(seqs)
        for s in [s for s in self.slots if s not in members]:
            self._release(s)
        for s in seqs:  # a sequence whose count does not match (it cannot, short of a bug) is copied afresh
            if s in self.slots and self.held[s] != len(s) - 1:
                self._release(s)
        if not self._reserve(len(seqs), max(len(s) for s in seqs)):
            self._clear()
            return None
        for s in seqs:
            if s not in self.slots:
                self._join(s, k_cache, v_cache)
            self.held[s] = len(s)  # after this step's write
        slot = [self.slots[s] for s in seqs]
        lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)
        order = None
        if slot != list(range(len(seqs))):
            order = torch.empty(len(seqs), dtype=torch.long)
            order[torch.tensor(slot)] = torch.arange(len(seqs))
            lens = lens[order]
        width = int(lens.max())
        return MirrorView(self.k, self.v, torch.tensor(slot, dtype=torch.long),
                          torch.tensor([len(s) - 1 for s in seqs], dtype=torch.long), order,
                          length_mask(lens, width, self.dtype), width)

    # ------------------------------------------------------------------ internals

    def _release(self, s) -> None:
        """Free ``s``'s slot; the sequence in the last slot moves into it, so slots stay 0 .. n-1."""
        free = self.slots.pop(s)
        self.held.pop(s)
        last = len(self.slots)
        if free != last:
            mover = next(t for t, i in self.slots.items() if i == last)
            n = self.held[mover]
            self.k[:, free, :, :n] = self.k[:, last, :, :n]
            self.v[:, free, :, :n] = self.v[:, last, :, :n]
            self.slots[mover] = free

    def _reserve(self, slots: int, positions: int) -> bool:
        """Room for ``slots`` sequences of up to ``positions`` tokens; if it must grow, exactly
        ``slots`` slots (the ones held are among them: ``step`` released the others) of capacity
        rounded up to ``GROW`` positions. False if that is over the budget."""
        have_slots, have_cap = self.k.shape[1], self.k.shape[3]
        if slots <= have_slots and positions <= have_cap:
            return True
        if positions > self.max_len:
            raise ValueError(f"a decoding sequence has {positions} tokens, over max_model_len={self.max_len}")
        cap = max(have_cap, min(self.max_len, -(-positions // GROW) * GROW))
        n = slots
        layers, kvh, d = self.shape
        if 2 * layers * n * kvh * cap * d * self.k.element_size() > self.budget:
            return False
        # zeroed: SDPA reads the masked positions past each context too, and 0 x NaN is NaN
        k = torch.zeros(layers, n, kvh, cap, d, dtype=self.dtype)
        v = torch.zeros_like(k)
        for s, i in self.slots.items():
            k[:, i, :, :self.held[s]] = self.k[:, i, :, :self.held[s]]
            v[:, i, :, :self.held[s]] = self.v[:, i, :, :self.held[s]]
        self.k, self.v = k, v
        return True

    def _clear(self) -> None:
        layers, kvh, d = self.shape
        self.k = torch.empty(layers, 0, kvh, 0, d, dtype=self.dtype)
        self.v = torch.empty_like(self.k)
        self.slots: dict = {}    # sequence -> slot
        self.held: dict = {}     # sequence -> tokens held (positions 0 .. held-1)

    def _join(self, s, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Copy ``s``'s first ``len(s) - 1`` tokens from the paged cache into the next free slot."""
        n = len(s) - 1
        i = len(self.slots)
        self.slots[s] = i
        self.held[s] = n
        bs = k_cache.shape[2]
        blocks = torch.tensor(s.block_table[:-(-n // bs)], dtype=torch.long)
        for cache, mine in ((k_cache, self.k), (v_cache, self.v)):
            layers, _, _, kvh, d = cache.shape
            rows = cache.index_select(1, blocks).view(layers, -1, kvh, d)[:, :n]  # [L, n, kvh, d]
            mine[:, i, :, :n] = rows.transpose(1, 2)
