"""Run-ahead decode: queueing a decode step before its inputs reach the host. ``RunAhead`` is
the part of ``ModelRunner`` that launches the steps; ``may_run_ahead`` and ``launch_ahead`` are
the engine's rule for when (``core.py``).

``launch_decode`` replays a decode graph of plain rows and queues an asynchronous copy of its
``sampled`` buffer into one of two host buffers (pinned on CUDA), with a CUDA event after it;
``launch_next`` then queues the next step for the same sequences without the host knowing its
tokens: a device-side copy of the sampled token ids into the graph's token-id input, positions
/ slots / context lengths incremented in place, a block-table entry and slot set for rows that
start a new block, and the replay. ``Launch.wait`` blocks on the event and reads the tokens.
Stream order makes it safe: the next step's input updates run after the previous replay has
read them, and the previous step's results were copied out before the next replay overwrites
``sampled``.

    launched = InFlight(batch.seqs, runner.launch_decode(batch), version)
    if may_run_ahead(scheduler, blocks, launched.seqs, max_model_len):
        ahead = launch_ahead(runner, blocks, launched, version)
    tokens, logprobs = launched.launch.wait()

In the engine (``run_ahead``, on by default wherever decode graphs exist): a decode step whose
rows are all sampled inside the graph is launched, its tokens are queued for an asynchronous
copy to the host, and -- when the next step is bound to be the same batch one position
further -- that next step is launched at once from the tokens still on the device, before
``Engine.step()`` waits for and post-processes the first. The host's per-step work
(scheduling, reading results, stop checks) then overlaps the GPU's next step instead of
leaving it idle (as vLLM's async scheduling and SGLang's overlap scheduler do). The step left
in flight is post-processed by the next ``step()``. It is launched only when it is safe: no
request waiting that the scheduler could admit, every sequence of the batch still running,
two tokens of ``max_tokens`` budget left, and a free block for any sequence whose next
position starts one (run-ahead never preempts). A sequence that finishes meanwhile (stop
token or string, abort) has its row of the step in flight dropped: that step wrote K/V only
for the token the sequence really produced, into a block it still owned, and no block is
published for the prefix cache before its K/V is computed. ``update_weights`` drops the step
in flight (it ran with the old weights) and the next step recomputes it with the new ones, so
outputs, logprobs and policy versions are exactly what they are without run-ahead.

Test: ``pytest tests/unit/inference -k run_ahead``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from opencomposer.inference.engine.block_manager import BlockManager
from opencomposer.inference.engine.sampler import is_plain
from opencomposer.inference.engine.scheduler import ScheduledBatch, Scheduler
from opencomposer.inference.engine.sequence import Sequence, Status


@dataclass
class Launch:
    """A decode step queued on the device (``launch_decode`` / ``launch_next``)."""

    n: int  # rows (sequences)
    bucket: int  # the graph it replayed
    host: torch.Tensor  # [2, max_num_seqs] host buffer that its [token ids, logprobs] are copied into
    event: Any  # CUDA event recorded after that copy; None on CPU (the copy is done)

    def wait(self) -> tuple[list[int], list[float]]:
        """Block until the step's results are on the host; -> (token ids, logprobs)."""
        if self.event is not None:
            self.event.synchronize()
        both = self.host[:, :self.n].tolist()
        return [int(t) for t in both[0]], both[1]


class RunAhead:
    """Mixed into ``ModelRunner``: uses its decode graphs (``graphs``, ``_bucket``, ``_static``,
    ``_replay_decode``, ``run``) and its two host buffers and events (``_results``, ``_events``)."""

    @torch.inference_mode()
    def launch_decode(self, batch: ScheduledBatch) -> Launch | None:
        """Start the decode step ``batch`` without waiting for it: one graph replay that
        samples every row, then an asynchronous copy of its tokens to the host (``Launch.wait``
        reads them). None, and nothing done, if it cannot be that: no graph holds the batch,
        or a row is not plain (``sampler.is_plain``)."""
        n = len(batch.seqs)
        bucket = self._bucket(n)
        if not batch.decode or bucket is None or not all(is_plain(s) for s in batch.seqs):
            return None
        self.run(batch)
        return self._queue_results(n, bucket)

    @torch.inference_mode()
    def launch_next(self, prev: Launch, new_blocks: list[tuple[int, int, int]]) -> Launch:
        """Start the decode step after ``prev`` for the same sequences, before ``prev``'s
        tokens reach the host: its input tokens are ``prev``'s sampled ones (copied on the
        device), positions, slots and context lengths one further along. ``new_blocks``: (row,
        block-table index, block) for each row whose next position starts a new block. All of
        it is queued on the device after ``prev`` (which read the buffers changed here), and
        ``prev``'s results were already queued to their own host buffer. At most two launches
        may be unread at a time (two host buffers, used in turn)."""
        st, n, bs = self._static, prev.n, self.block_size
        vec = st["vec"]
        vec[0, :n].copy_(st["sampled"][0, :n])  # float64 token ids -> int64, on the device
        vec[1:, :n] += 1  # positions, slots (right unless a new block starts: set below), lengths
        for row, index, block in new_blocks:
            st["tables"][row, index:index + 1].fill_(block)
            vec[2, row:row + 1].fill_(block * bs)
        self._replay_decode(prev.bucket)
        return self._queue_results(n, prev.bucket)

    def _queue_results(self, n: int, bucket: int) -> Launch:
        self._turn ^= 1
        host, event = self._results[self._turn], self._events[self._turn]
        host.copy_(self._static["sampled"], non_blocking=True)  # the whole buffer: contiguous, one copy
        if event is not None:
            event.record()
        return Launch(n, bucket, host, event)


@dataclass
class InFlight:
    """A decode step launched on the device whose sampled tokens have not been read."""

    seqs: list[Sequence]  # its rows
    launch: Launch
    version: int  # policy version of the weights it runs with


def may_run_ahead(scheduler: Scheduler, blocks: BlockManager, seqs: list[Sequence], max_model_len: int) -> bool:
    """Can the step after the one just launched for ``seqs`` start before its tokens are
    known? Only if the next step would be the same decode batch anyway and nobody can
    need preempting for it."""
    sch = scheduler
    if sch.waiting and len(sch.running) < sch.max_num_seqs:
        return False  # the next schedule() may admit a waiting request
    if len(sch.running) != len(seqs) or any(s.status is not Status.RUNNING for s in seqs):
        return False
    bs = blocks.block_size
    new_blocks = 0
    for s in seqs:
        # the launched step makes token num_generated + 1; the next one, + 2, at position len(s)
        if s.num_generated + 2 > s.params.max_tokens or len(s) + 2 > max_model_len:
            return False
        new_blocks += len(s) + 1 > len(s.block_table) * bs
    return new_blocks <= blocks.num_free


def launch_ahead(runner: RunAhead, blocks: BlockManager, launched: InFlight, version: int) -> InFlight:
    """Launch the step after ``launched`` (``may_run_ahead`` said it may), taking a block for
    each sequence whose next position starts one; it runs with the weights of ``version``."""
    bs = blocks.block_size
    new_blocks = []
    for row, s in enumerate(launched.seqs):
        if len(s) + 1 > len(s.block_table) * bs:  # position len(s) starts a block
            blocks.append_slot(s, len(s) + 1)
            new_blocks.append((row, len(s.block_table) - 1, s.block_table[-1]))
    return InFlight(launched.seqs, runner.launch_next(launched.launch, new_blocks), version)
