"""``BatchedPolicy``: one local model serving many concurrent episodes, in batches or continuously.

Rollouts run one episode per thread, each with its own sandbox and its own ``Agent``
(the deployed harness, unchanged). Every ``Agent`` calls ``policy.act`` as if it were
alone; this class queues those calls and a single generation worker runs them through
``ModelPolicy.sample_batch`` (one left-padded ``generate``), so the model does one big
forward per token instead of one per episode::

    with BatchedPolicy(ModelPolicy("smollm2-135m", max_new_tokens=256), max_batch=8) as policy:
        def episode(task):
            with policy.episode():          # counts as live while it runs
                return run_task(task, policy, "local", cfg)
        ...threads...
    policy.batch_sizes                      # Counter {batch size: number of batches}
    policy.stats                            # generate_seconds, batches, requests (resettable)

When is a batch formed? When every live episode (``episode()`` / ``register()``) has a
request pending, or ``max_batch`` requests are pending, or ``max_wait`` seconds have
passed since the oldest pending request (or since the last batch ended, if later): episodes
busy in a tool (running tests) must not stall the others for long. Prompts are rendered and tokenised in the calling thread, so a
prompt that does not fit raises ``ContextLengthError`` there, for that request only.

Continuous mode (the default over an ``EnginePolicy``; ``continuous=False`` forces batches):
the worker owns the engine and adds each request as it arrives (up to ``max_batch`` sequences
in the engine at once, the rest queue), steps it, and hands each request back the moment ITS
sequence finishes, so nobody waits for a batch's longest turn or for a batch to start
(``max_wait`` and the live-episode count do not matter then). Weights a trainer sends with
``policy.policy.update_weights`` enter between two engine steps (the engine's lock); tokens
after it carry the new version (``PolicyOutput.policy_versions``). ``stats`` then counts
engine steps as ``batches``, sequences in the engine summed over steps as
``sequence_steps`` (``mean_running`` = their ratio), and ``generate_seconds`` is the wall time
with any request in the engine; ``queue_seconds`` sums the time requests waited for room in
the engine (``max_batch``); ``batch_sizes`` is the histogram of sequences per step. A
failed engine step fails the requests then in the engine (``EngineStepError``, a
``BatchGenerationError``), which are aborted, and the worker goes on serving later ones; so
does a failed batch in batch mode. A request's own failure (its prompt refused by the engine)
is a plain ``BatchGenerationError``. ``policies/fanout.py`` tells the two apart: a failed step
takes an engine out of dispatch.

Everything the sampler means (GenerationConfig, stop tokens, logprobs, context rule) is
``ModelPolicy``'s; ``policy_version`` is the wrapped policy's (a trainer bumps either) and is
read when each batch starts generating (continuous: per token, the engine's). With a ``seed``
the wrapped policy seeds each ``generate`` call (continuous: each request is a call of its
own, seeded ``seed + n * 100_003`` for the n-th request the worker takes, with a generator of
its own, so batch-mates do not matter), but which prompts share a batch, or which request is
the n-th, depends on thread timing, so concurrent sampling is not reproducible run to run;
greedy (``temperature=0``) output is.

Test: ``pytest tests/unit/episode/test_rollout.py -k batch``; continuous mode:
``pytest tests/unit/policies/test_continuous.py``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator

from opencomposer.policies.engine import EnginePolicy
from opencomposer.policies.model import ModelPolicy
from opencomposer.protocols import Message, PolicyOutput


class BatchGenerationError(RuntimeError):
    """Generating the batch this request was in failed; ``__cause__`` is the original error."""


class PolicyClosed(RuntimeError):
    """The policy was closed before this request was queued: nothing of it ran."""


class EngineStepError(BatchGenerationError):
    """The whole engine step (batch mode: the whole batch) this request was in failed, not the
    request alone: the engine itself is suspect."""


@dataclass
class _Request:
    prompt_ids: list[int]
    arrived: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    output: PolicyOutput | None = None
    error: BaseException | None = None
    step_failed: bool = False  # the error is the whole step's or batch's (EngineStepError)


class BatchedPolicy:
    """Implements ``Policy`` for many threads at once over one ``ModelPolicy``.

    ``max_batch`` caps the rows of one ``generate``; ``max_wait`` (seconds) is how long the
    oldest request waits for the other live episodes to catch up. ``continuous`` (default: is
    ``policy`` an ``EnginePolicy``) serves requests one engine step at a time instead, with
    ``max_batch`` the cap of sequences in the engine. Close it (or use ``with``) to stop the
    worker thread; requests still queued then fail instead of hanging.
    """

    def __init__(self, policy: ModelPolicy | EnginePolicy, max_batch: int = 8, max_wait: float = 0.05,
                 name: str | None = None, continuous: bool | None = None):
        if max_batch < 1 or max_wait < 0:
            raise ValueError(f"need max_batch >= 1 and max_wait >= 0; got max_batch={max_batch}, max_wait={max_wait}")
        self.continuous = isinstance(policy, EnginePolicy) if continuous is None else continuous
        if self.continuous and not isinstance(policy, EnginePolicy):
            raise ValueError(f"continuous=True needs an EnginePolicy (an engine to step); got {type(policy).__name__}")
        self.policy = policy
        self.name = name or policy.name
        self.max_batch, self.max_wait = max_batch, max_wait
        self.batch_sizes: Counter[int] = Counter()  # histogram: batch size -> batches run
        # Running totals for step reports; a caller may reset any of them to 0 between steps.
        self.stats: dict[str, float] = {"generate_seconds": 0.0, "batches": 0, "requests": 0, "sequence_steps": 0,
                                        "queue_seconds": 0.0, "worker_cpu_seconds": 0.0}
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._live = 0
        self._closed = False
        self._free_since = 0.0  # when the worker finished its last batch (monotonic)
        work = self._serve if self.continuous else self._work
        self._worker = threading.Thread(target=work, name=f"batched-{self.name}", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ Policy

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    @property
    def policy_version(self) -> int:
        return self.policy.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.policy.policy_version = version

    @property
    def mean_running(self) -> float:
        """Sequences per batch (continuous: in the engine per step), over ``stats``' window."""
        return self.stats["sequence_steps"] / self.stats["batches"] if self.stats["batches"] else 0.0

    def engine_counts(self) -> dict[str, float]:
        """The built-in engine's running counters (``Engine.counts``: tokens, steps, seconds); {}
        over any other policy."""
        return dict(self.policy.engine.counts()) if isinstance(self.policy, EnginePolicy) else {}

    def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> PolicyOutput:
        request = _Request(self.policy.encode(messages, tools))  # ContextLengthError: this caller only
        with self._cond:
            if self._closed:
                raise PolicyClosed(f"BatchedPolicy {self.name!r} is closed; no worker will answer")
            self._pending.append(request)
            self._cond.notify_all()
        request.done.wait()
        if request.error is not None:
            raise (EngineStepError if request.step_failed else BatchGenerationError)(
                f"generating a batch on {self.name} failed: {type(request.error).__name__}: {request.error}"
            ) from request.error
        assert request.output is not None  # the worker sets output or error before done
        return request.output

    # ------------------------------------------------------------------ live episodes

    def register(self) -> None:
        with self._cond:
            self._live += 1

    def unregister(self) -> None:
        with self._cond:
            if self._live < 1:
                raise RuntimeError("unregister() without a matching register()")
            self._live -= 1
            self._cond.notify_all()  # the worker may be waiting for this episode's request

    @contextmanager
    def episode(self, group: Hashable | None = None) -> Iterator[BatchedPolicy]:
        """Count the calling episode as live (the worker waits for its request) while inside;
        yields the policy the episode talks to (this one). ``group`` (the episode's GRPO group)
        matters to ``FanoutPolicy`` only: one engine serves every group here."""
        self.register()
        try:
            yield self
        finally:
            self.unregister()

    # ------------------------------------------------------------------ worker

    def _next_batch(self) -> list[_Request]:
        """Block until a batch is due; an empty list means closed and drained."""
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            if not self._pending:
                return []
            # The grace period starts when the worker is free, not when the oldest request
            # came: requests that queued up during the last batch would otherwise go at
            # once, alone, while that batch's episodes are a few ms from asking again, and
            # the episodes would settle into two half-size batches taking turns.
            deadline = max(self._pending[0].arrived, self._free_since) + self.max_wait
            while not self._closed and len(self._pending) < min(self.max_batch, max(self._live, 1)):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            return batch

    def _run(self, batch: list[_Request]) -> None:
        started = time.monotonic()
        try:
            outputs = self.policy.sample_batch([r.prompt_ids for r in batch])
            for request, output in zip(batch, outputs):
                request.output = output
        except BaseException as e:  # every waiting caller must hear of it, whatever it is
            for request in batch:
                request.error, request.step_failed = e, True
            if not isinstance(e, Exception):
                raise
        finally:
            with self._cond:
                self.batch_sizes[len(batch)] += 1
                self._free_since = time.monotonic()
                self.stats["generate_seconds"] += self._free_since - started
                self.stats["batches"] += 1
                self.stats["requests"] += len(batch)
                self.stats["sequence_steps"] += len(batch)
            for request in batch:
                request.done.set()

    def _work(self) -> None:
        try:
            while batch := self._next_batch():
                self._run(batch)
        finally:
            self._strand([])

    # ------------------------------------------------------------------ continuous worker

    def _serve(self) -> None:
        """Continuous mode: take what is pending (up to ``max_batch`` in the engine), one engine
        step, hand back what finished; until closed and drained."""
        engine = self.policy.engine
        running: dict[str, _Request] = {}
        try:
            while (joining := self._joining(running)) is not None:
                started, cpu = time.monotonic(), time.thread_time()
                for request in joining:
                    self._add(engine, request, running)
                finished = self._step(engine, running) if running else []
                with self._cond:
                    self.stats["generate_seconds"] += time.monotonic() - started
                    # the worker's own CPU time (engine steps, adding requests, reading finished ones)
                    self.stats["worker_cpu_seconds"] += time.thread_time() - cpu
                for request in finished:
                    request.done.set()
        finally:
            self._strand(list(running.values()))

    def _joining(self, running: dict[str, _Request]) -> list[_Request] | None:
        """The pending requests that join the engine now ([] to step on without new ones);
        blocks while there is nothing to do, None once closed and drained."""
        with self._cond:
            while not self._pending and not running and not self._closed:
                self._cond.wait()
            if not self._pending and not running:
                return None
            room = max(self.max_batch - len(running), 0)
            joining, self._pending = self._pending[:room], self._pending[room:]
            now = time.monotonic()  # how long each waited for room in the engine (max_batch)
            self.stats["queue_seconds"] += sum(now - r.arrived for r in joining)
            return joining

    def _add(self, engine: Any, request: _Request, running: dict[str, _Request]) -> None:
        try:
            running[engine.add_request(request.prompt_ids, self.policy.next_params(request.prompt_ids))] = request
        except Exception as e:  # this request's own failure (its prompt checked in the engine)
            request.error = e
            with self._cond:
                self.stats["requests"] += 1
            request.done.set()

    def _step(self, engine: Any, running: dict[str, _Request]) -> list[_Request]:
        """One engine step; the requests it finished (outputs or errors set, removed from
        ``running``). A failed step fails and aborts every request in the engine."""
        n = len(running)
        try:
            outs = engine.step()
        except Exception as e:
            finished = list(running.values())
            for rid, request in running.items():
                request.error, request.step_failed = e, True
                self._forget(engine, rid)
            running.clear()
        else:
            finished = []
            for out in outs:
                request = running.pop(out.request_id, None) if out.finished else None
                if request is None:
                    continue
                try:
                    request.output = self.policy.output(engine.completion(out.request_id))
                except Exception as e:
                    request.error = e
                finished.append(request)
        with self._cond:
            self.batch_sizes[n] += 1
            self.stats["batches"] += 1
            self.stats["sequence_steps"] += n
            self.stats["requests"] += len(finished)
        return finished

    @staticmethod
    def _forget(engine: Any, rid: str) -> None:
        """Abort ``rid`` and drop its result; an engine too broken to do so is left as it is
        (the next step reports the abort, or fails the next requests)."""
        try:
            engine.abort(rid)
            engine.completion(rid)
        except Exception:
            pass

    def _strand(self, running: list[_Request]) -> None:
        """Reached on close, or if the worker itself dies: nobody may wait forever."""
        with self._cond:
            self._closed = True
            stranded, self._pending = running + self._pending, []
        for request in stranded:
            if request.done.is_set():
                continue
            request.error = RuntimeError("the batching worker stopped before this request ran")
            request.done.set()

    def close(self) -> None:
        """Finish queued requests, then stop the worker (and the wrapped policy's connections,
        if it has any: ``ServerPolicy``)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join()
        if hasattr(self.policy, "close"):
            self.policy.close()

    def __enter__(self) -> "BatchedPolicy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
