"""``RolloutsAhead``: rollout batches collected in a thread, a bounded number ahead of the trainer.

    ahead = RolloutsAhead(produce=actor.collect_batch, ahead=1, total=steps, interrupt=policy.close)
    ahead.start()
    batch, waited_s = ahead.get()      # the next batch, in order; the thread's error re-raised here
    ahead.redo()                       # the trainer dropped it (too stale): one batch more is needed
    ahead.close()                      # always (finally): stops the thread, interrupting a collection

The asynchronous half of ``[rollout] max_staleness = N`` (``rl/actor.py`` holds the other): while
the trainer updates on batch s, this thread collects batches s+1 .. s+N with whatever weights
the engine has, and every update reaches the engine in flight (between two decode steps), so
one rollout's tokens may come from several versions. At most ``ahead`` batches are collected
or waiting that the trainer has not taken: a batch started when the trainer takes batch s - N
is trained after update s, so its oldest token is at most N versions old when weights reach
the engine as soon as they exist (``builtin``). ``total`` stops the thread at the run's last
step instead of collecting a batch nobody trains.

Shutdown: ``close`` stops the thread; a collection in progress is cut short by ``interrupt``
(closing the batched policy: episodes waiting for a model turn end at once, each closes its
sandbox), so an error or Ctrl-C in the trainer never leaves a hung process. An exception in
the thread is re-raised by the trainer's next ``get`` as ``RolloutThreadError`` whose cause
carries the thread's traceback.

Test: ``pytest tests/unit/rl/test_async_rollouts.py tests/integration/test_async_rl.py``.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class RolloutThreadError(RuntimeError):
    """Collecting rollouts ahead of the trainer failed; ``__cause__`` is the thread's exception."""


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class RolloutsAhead(Generic[T]):
    def __init__(self, produce: Callable[[], T], ahead: int, total: int,
                 interrupt: Callable[[], None] | None = None, join_timeout_s: float = 120.0):
        if ahead < 1 or total < 0:
            raise ValueError(f"need ahead >= 1 and total >= 0; got ahead={ahead}, total={total}")
        self.produce, self.ahead, self.total = produce, ahead, total
        self.interrupt, self.join_timeout_s = interrupt, join_timeout_s
        self.produced = 0  # batches started (the one being collected included)
        self.in_flight = 0  # started, not taken by the trainer yet
        self.idle_seconds = 0.0  # the thread waiting for the trainer (the bound); a caller may reset it
        self._busy = False
        self._stop = False
        self._cond = threading.Condition()
        self._out: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="rollouts-ahead", daemon=True)

    def start(self) -> "RolloutsAhead[T]":
        self._thread.start()
        return self

    # ------------------------------------------------------------------ trainer side

    def get(self) -> tuple[T, float]:
        """The next batch and the seconds waited for it."""
        t0 = time.perf_counter()
        while True:
            try:
                item = self._out.get(timeout=0.2)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._out.empty():
                    raise RolloutThreadError("the rollout thread stopped without a batch") from None
        with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()
        if isinstance(item, _Failed):
            raise RolloutThreadError(f"collecting rollouts failed: {type(item.error).__name__}: {item.error}") \
                from item.error
        return item, time.perf_counter() - t0

    def redo(self) -> None:
        """One batch more than planned (the trainer dropped one)."""
        with self._cond:
            self.total += 1
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread (interrupting a collection in progress) and wait for it."""
        with self._cond:
            self._stop = True
            busy = self._busy
            self._cond.notify_all()
        try:
            if busy and self.interrupt is not None:
                self.interrupt()
        finally:  # the thread is a daemon: a collection that outlasts the timeout cannot hang the exit
            if self._thread.is_alive():
                self._thread.join(self.join_timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        try:
            while self._wait_for_room():
                batch = self.produce()
                with self._cond:
                    self._busy = False
                self._out.put(batch)
        except BaseException as e:  # the trainer hears of it at its next get()
            with self._cond:
                self._busy = False
            self._out.put(_Failed(e))

    def _wait_for_room(self) -> bool:
        """Block until a batch may start (False: stopped); the start is counted in flight."""
        with self._cond:
            t0 = time.perf_counter()
            while not self._stop and (self.in_flight >= self.ahead or self.produced >= self.total):
                self._cond.wait()
            if self.produced < self.total:  # not the wait after the last batch: nothing to do then
                self.idle_seconds += time.perf_counter() - t0
            if self._stop:
                return False
            self.in_flight += 1
            self.produced += 1
            self._busy = True
            return True
