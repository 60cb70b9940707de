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

Hashing every block of a resent history is most of the host work of an agent turn's prefill
step (~200 blocks of a 3,000-token history). So a freed sequence is also remembered as a
*line*: its tokens, its leading computed blocks, their hashes, and each block's hand-out
count (``gen``). A later prompt that starts with a line's tokens (its next turn, or a
sibling rollout's) takes the hashes and blocks from the line -- one list comparison in C
for the tokens, and each block checked to be unchanged since (same ``gen``, still published
under that hash) -- and hashes only the blocks after. The result is exactly what hashing
every block finds. Lines are found by their tokens at every ``line_mark``-th block.

Weight updates invalidate the prefix cache (``invalidate``): K/V computed by old weights
is never given to a request admitted after the update. Sequences already running keep
their blocks (their earlier tokens' K/V stay as the old weights made them, which is what
in-flight updates mean), but blocks they fill later are not published for reuse.

Test: ``pytest tests/unit/inference/test_block_manager.py tests/unit/inference/test_prefill_host.py``
(lines, and every allocation against the block-by-block lookup).
"""

from __future__ import annotations

from collections import OrderedDict

from opencomposer.inference.engine.sequence import Sequence


def kv_slots(table, positions, block_size: int):
    """The cache slots of a sequence's tokens at ``positions`` (an int, or a numpy / torch
    array) given its block table: block ``table[p // block_size]``, offset ``p % block_size``."""
    return table[positions // block_size] * block_size + positions % block_size


class NoFreeBlocks(RuntimeError):
    """The cache has no free block; the scheduler preempts a sequence and retries."""


class _Line:
    """A freed sequence's leading computed blocks (see the module docstring)."""

    __slots__ = ("blocks", "gens", "hashes", "keys", "tokens")

    def __init__(self, tokens: list[int], blocks: list[int], hashes: list[int], gens: list[int], keys: list[tuple]):
        self.tokens, self.blocks, self.hashes, self.gens, self.keys = tokens, blocks, hashes, gens, keys


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_lines: int = 256, line_mark: int = 16):
        """``max_lines``: freed sequences remembered for fast prefix lookup (0: none; each
        keeps its token list alive, ~8 bytes a token); a line is found by its tokens at blocks
        ``line_mark - 1``, ``2 * line_mark - 1``, ... (shorter ones are not kept)."""
        if num_blocks < 1 or block_size < 1 or max_lines < 0 or line_mark < 1:
            raise ValueError(f"need num_blocks >= 1, block_size >= 1, max_lines >= 0 and line_mark >= 1; "
                             f"got {num_blocks}, {block_size}, {max_lines}, {line_mark}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.epoch = 0
        self.hit_tokens = 0  # prompt tokens served from the cache, since start
        self.line_hit_tokens = 0  # of those, found through a remembered line (not hashed again)
        self.gen = [0] * num_blocks  # times each block was handed out
        self.max_lines, self.line_mark = max_lines, line_mark
        self.lines: OrderedDict[int, _Line] = OrderedDict()  # oldest first
        self.marks: dict[tuple, dict[int, _Line]] = {}  # (block index, its tokens) -> {id: line}, newest last

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
        # an agent turn resends its whole history: a remembered line covers most of it, and
        # this loop hashes the rest, kept lean (blocks cut by zip, lookups bound to locals)
        hits, hashes = self._from_line(seq.token_ids, full)
        from_line = len(hits)
        parent = hashes[-1] if hashes else None
        lookup, owner_tokens, chain_hash = self.cached.get, self.block_tokens, self.chain_hash
        for tokens in _full_blocks(seq.token_ids, bs, len(hits), full):
            h = chain_hash(parent, tokens)
            block = lookup(h)
            if block is None or owner_tokens[block] != tokens:
                break
            hits.append(block)
            hashes.append(h)
            parent = h
        ref = self.ref
        reclaimed = sum(1 for b in hits if not ref[b])  # hit blocks in the free list (cached, unowned)
        total = self.blocks_for(len(seq))
        if total - len(hits) + reclaimed > self.num_free:
            return False
        free = self.free
        for b in hits:
            if not ref[b]:
                del free[b]  # cached, unowned: out of the free list
            ref[b] += 1
        found = len(hits)
        hits.extend(self._take() for _ in range(total - found))
        seq.block_table = hits
        seq.block_hashes = hashes
        seq.num_computed = found * bs
        seq.cache_epoch = self.epoch
        self.hit_tokens += seq.num_computed
        self.line_hit_tokens += from_line * bs
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
        # which more requests share. Blocks past what ``seq`` computed that were published
        # ahead for a step it never ran (see ``publish``) are withdrawn: their K/V was never written.
        computed = seq.num_computed // self.block_size
        self._remember(seq, computed)
        for i in range(len(seq.block_table) - 1, -1, -1):
            b = seq.block_table[i]
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if i >= computed:
                    self._forget(b)
                self.free[b] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0

    def publish(self, seq: Sequence, computed: int | None = None) -> None:
        """Hash and publish ``seq``'s newly completed, computed full blocks for reuse.

        ``computed``: publish up to this many tokens instead of ``seq.num_computed`` -- the
        scheduler passes what the step being scheduled will have computed, so that a later
        sequence of the same step reuses those blocks (several rollouts of one prompt
        submitted together compute the prompt once). That is safe because every step writes
        all its tokens' K/V into the cache before any sequence's attention reads it, layer
        by layer; ``Engine`` invalidates the cache if a step fails, and ``free_seq`` withdraws
        them from a sequence freed before its step ran."""
        if seq.cache_epoch != self.epoch:
            return  # computed (partly) under older weights
        bs, hashes = self.block_size, seq.block_hashes
        done, stop = len(hashes), (seq.num_computed if computed is None else computed) // bs
        if done >= stop:
            return  # no block completed since (most decode steps)
        for b, tokens in zip(seq.block_table[done:stop], _full_blocks(seq.token_ids, bs, done, stop)):
            h = self.chain_hash(hashes[-1] if hashes else None, tokens)
            hashes.append(h)
            if h not in self.cached and self.block_hash[b] is None:
                self.cached[h] = b
                self.block_hash[b] = h
                self.block_tokens[b] = tokens

    def invalidate(self) -> None:
        """Forget every cached prefix (weights changed)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks
        self.lines.clear()
        self.marks.clear()
        self.epoch += 1

    def _take(self) -> int:
        b, _ = self.free.popitem(last=False)
        self._forget(b)  # evict its cached prefix entry
        self.ref[b] = 1
        self.gen[b] += 1  # lines that remember this block no longer vouch for it
        return b

    # ------------------------------------------------------------------ lines

    def _remember(self, seq: Sequence, computed: int) -> None:
        """Keep ``seq``'s leading computed, hashed blocks as a line (it is being freed)."""
        n, mark = min(len(seq.block_hashes), computed), self.line_mark
        if not self.max_lines or n < mark or seq.cache_epoch != self.epoch:
            return
        blocks = seq.block_table[:n]
        keys = [self._mark(seq.token_ids, k) for k in range(mark - 1, n, mark)]
        line = _Line(seq.token_ids, blocks, seq.block_hashes[:n], [self.gen[b] for b in blocks], keys)
        for key in keys:
            self.marks.setdefault(key, {})[id(line)] = line
        self.lines[id(line)] = line
        if len(self.lines) > self.max_lines:
            self._drop(self.lines.popitem(last=False)[1])

    def _mark(self, tokens: list[int], k: int) -> tuple:
        """The index key of block ``k`` of ``tokens``."""
        return k, tuple(tokens[k * self.block_size:(k + 1) * self.block_size])

    def _drop(self, line: _Line) -> None:
        for key in line.keys:
            lines = self.marks[key]
            del lines[id(line)]
            if not lines:
                del self.marks[key]

    def _from_line(self, tokens: list[int], full: int) -> tuple[list[int], list[int]]:
        """The leading blocks (and their hashes) of ``tokens``' first ``full`` blocks that a
        remembered line holds unchanged; ([], []) if none. Tries the deepest mark first, and
        there the newest lines; gives up (the caller hashes every block) after 8 lines whose
        tokens differ before that mark, which only repetitive prompts meet."""
        if not self.marks:
            return [], []
        bs, mark, tries = self.block_size, self.line_mark, 8
        for k in range(full // mark * mark - 1, -1, -mark):
            for line in reversed(self.marks.get(self._mark(tokens, k), {}).values()):
                # the blocks shared: as far as the line goes, else up to this mark, else none
                m = next((m for m in (min(len(line.blocks), full), k + 1) if tokens[:m * bs] == line.tokens[:m * bs]), 0)
                if m:
                    return self._unchanged(line, m)
                tries -= 1
                if not tries:
                    return [], []
        return [], []

    def _unchanged(self, line: _Line, m: int) -> tuple[list[int], list[int]]:
        """``line``'s first blocks, up to ``m``, that were not handed out again since and are
        still published under the line's hash: what the block-by-block lookup would find."""
        gen, block_hash = self.gen, self.block_hash
        blocks, hashes = line.blocks[:m], line.hashes[:m]
        if [gen[b] for b in blocks] == line.gens[:m] and [block_hash[b] for b in blocks] == hashes:
            return blocks, hashes
        i = 0
        while gen[blocks[i]] == line.gens[i] and block_hash[blocks[i]] == hashes[i]:
            i += 1
        return blocks[:i], hashes[:i]

    def _forget(self, b: int) -> None:
        """Block ``b`` no longer holds a reusable prefix block."""
        h = self.block_hash[b]
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
            self.block_hash[b] = None
            self.block_tokens[b] = None


def _full_blocks(token_ids: list[int], block_size: int, first: int, stop: int):
    """Token-id tuples of blocks ``first`` .. ``stop - 1`` (all full), cut in C by ``zip``."""
    return zip(*[iter(token_ids[first * block_size:stop * block_size])] * block_size)
