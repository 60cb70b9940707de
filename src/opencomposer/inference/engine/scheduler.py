"""``Scheduler``: which sequences run in the next model step (continuous batching).

Each step is either a prefill step or a decode step:

* prefill: admit waiting sequences in arrival order while there are sequence slots and
  KV blocks, up to ``max_num_batched_tokens`` new tokens per step; a prompt longer than
  that budget is prefilled in chunks over several steps (chunked prefill). Prompt blocks
  already in the prefix cache are not computed again, nor are those an earlier sequence
  of the same step computes (n samples of one prompt submitted together).
* decode: every running sequence gets one token. When the cache is full, the most
  recently admitted sequence is preempted: its blocks are freed and it goes back to the
  front of the queue, to be recomputed (prompt + what it generated so far) later.

Prefill goes first, so new requests join the running batch as soon as they arrive.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from opencomposer.inference.engine.block_manager import BlockManager
from opencomposer.inference.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    decode: bool
    seqs: list[Sequence] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # new tokens per sequence this step

    def samples(self, seq_index: int) -> bool:
        """Does this step end with a token sampled for ``seqs[seq_index]``?"""
        seq = self.seqs[seq_index]
        return self.decode or seq.num_computed + self.chunks[seq_index] == len(seq)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        batch = self._prefill()
        if batch.seqs:
            return batch
        return self._decode() if self.running else None

    def _prefill(self) -> ScheduledBatch:
        batch = ScheduledBatch(decode=False)
        budget = self.max_num_batched_tokens
        # an admitted sequence joins ``running`` as it joins the batch (counting both admitted at
        # most half of max_num_seqs per step); a partly prefilled one ends the loop below
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                if not self.blocks.allocate(seq):
                    break
                if seq.cached_prompt_tokens < 0:
                    seq.cached_prompt_tokens = seq.num_computed
            chunk = min(len(seq) - seq.num_computed, budget)
            budget -= chunk
            batch.seqs.append(seq)
            batch.chunks.append(chunk)
            # the blocks this step fills are reusable by the sequences admitted after it in this
            # same step (a group of rollouts of one prompt computes the prompt once)
            self.blocks.publish(seq, seq.num_computed + chunk)
            if seq.num_computed + chunk < len(seq):
                break  # the rest of this prompt goes in the next steps
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
        return batch

    def _decode(self) -> ScheduledBatch:
        batch = ScheduledBatch(decode=True)
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted below, earlier in this loop
            while not self.blocks.can_append(seq):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.blocks.append_slot(seq)
                batch.seqs.append(seq)
                batch.chunks.append(1)
        return batch

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = Status.FINISHED
