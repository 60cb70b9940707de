"""Run-ahead decode, the part of ``ModelRunner`` that queues decode steps before their
inputs reach the host (``model_runner.py``'s docstring tells how and why it is safe).

``launch_decode`` replays a decode graph of plain rows and queues an asynchronous copy of its
sampled tokens into one of two host buffers, with a CUDA event after it; ``launch_next``
queues the next step for the same sequences on the device alone (the sampled ids copied into
the graph's input, positions / slots / lengths advanced in place, new blocks set);
``Launch.wait`` reads the tokens.

Test: ``pytest tests/unit/inference -k run_ahead``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from opencomposer.inference.engine.sampler import is_plain
from opencomposer.inference.engine.scheduler import ScheduledBatch


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
