"""``BlockManager``: the paged KV cache's bookkeeping, with prefix caching.

The cache is ``num_blocks`` blocks of ``block_size`` token slots. A sequence holds a list
of blocks; blocks are reference-counted so that several sequences can share the blocks of
a common prefix. Prefix caching (agent turns resend the whole history): a block that is
full and computed gets a hash of (hash of the block before it, its token ids); a new
sequence whose leading blocks hash the same reuses them and skips computing them. Only
whole blocks are shared, and at least one prompt token is always computed, because the
step must produce logits to sample from.

A freed block keeps its hash and contents until it is handed out again (oldest freed
first), so a finished turn's KV stays reusable by the next turn while memory allows.

Weight updates invalidate the prefix cache (``invalidate``): K/V computed by old weights
is never given to a request admitted after the update. Sequences already running keep
their blocks (their earlier tokens' K/V stay as the old weights made them, which is what
in-flight updates mean), but blocks they fill later are not published for reuse.

Test: ``pytest tests/unit/inference/test_block_manager.py``.
"""

from __future__ import annotations

from collections import OrderedDict

from opencomposer.inference.sequence import Sequence


class NoFreeBlocks(RuntimeError):
    """The cache has no free block; the scheduler preempts a sequence and retries."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1; got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.epoch = 0
        self.hit_tokens = 0  # prompt tokens served from the cache, since start

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    # ------------------------------------------------------------------ allocation

    def allocate(self, seq: Sequence) -> bool:
        """Give ``seq`` blocks for all its tokens, reusing cached prefix blocks.

        Returns False (and changes nothing) if there are not enough free blocks. Sets
        ``seq.num_computed`` to the number of tokens found in the cache.
        """
        bs = self.block_size
        # leave at least one token to compute: its logits are what the step samples from
        full = (len(seq) - 1) // bs
        hits: list[int] = []
        hashes: list[int] = []
        parent = None
        for i in range(full):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = self.chain_hash(parent, tokens)
            block = self.cached.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            hits.append(block)
            hashes.append(h)
            parent = h
        total = self.blocks_for(len(seq))
        reclaimed = sum(1 for b in hits if self.ref[b] == 0)
        if total - len(hits) + reclaimed > self.num_free:
            return False
        table = []
        for b in hits:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            table.append(b)
        for _ in range(total - len(hits)):
            table.append(self._take())
        seq.block_table = table
        seq.block_hashes = hashes
        seq.num_computed = len(hits) * bs
        seq.cache_epoch = self.epoch
        self.hit_tokens += seq.num_computed
        return True

    def can_append(self, seq: Sequence) -> bool:
        return len(seq) <= len(seq.block_table) * self.block_size or self.num_free > 0

    def append_slot(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Make room for ``seq``'s last token (called before it is computed), or for its first
        ``num_tokens`` (at most one block more than it has)."""
        if (len(seq) if num_tokens is None else num_tokens) > len(seq.block_table) * self.block_size:
            if not self.free:
                raise NoFreeBlocks("no free KV block")
            seq.block_table.append(self._take())

    def free_seq(self, seq: Sequence) -> None:
        # Release in reverse so a prefix's tail blocks are reused before its head blocks,
        # which more requests share.
        for b in reversed(seq.block_table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0

    def publish(self, seq: Sequence) -> None:
        """Hash and publish ``seq``'s newly completed, computed full blocks for reuse."""
        if seq.cache_epoch != self.epoch:
            return  # computed (partly) under older weights
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = self.chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            b = seq.block_table[i]
            if h not in self.cached and self.block_hash[b] is None:
                self.cached[h] = b
                self.block_hash[b] = h
                self.block_tokens[b] = tokens

    def invalidate(self) -> None:
        """Forget every cached prefix (weights changed)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks
        self.epoch += 1

    def _take(self) -> int:
        b, _ = self.free.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:  # evict its cached prefix entry
            if self.cached.get(h) == b:
                del self.cached[h]
            self.block_hash[b] = None
            self.block_tokens[b] = None
        self.ref[b] = 1
        return b
