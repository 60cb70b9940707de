"""``EngineLoop``: one background thread owns the engine; asyncio handlers talk to it.

``Engine.step()`` is not thread-safe, so exactly one thread calls anything on the engine.
HTTP handlers (on the asyncio event loop) send it commands through a thread-safe inbox
(add a request, abort one, run a function such as ``engine.stats``) and receive the
``StepOutput``s of each HTTP request's sequences on one ``asyncio.Queue`` per request
(a ``Group``), fed with ``call_soon_threadsafe`` once per engine step. A finished
sequence's ``Completion`` is read from the engine (which keeps it until read) and put on
its handle.

Back-pressure: at most ``max_pending`` sequences may be admitted and unfinished at once
(waiting or running in the engine). ``reserve`` beyond that raises ``Overloaded`` at once,
before any work is done, and the server answers 429 with ``Retry-After``.

    loop = EngineLoop(engine, max_pending=256).start()
    loop.reserve(1)                                   # or Overloaded -> HTTP 429
    group = loop.submit([(prompt_ids, SamplingParams(max_tokens=16))])
    async for index, out in group: ...                # StepOutputs until all finished
    await loop.call(engine.stats)                     # run on the engine thread
    loop.stop()

Test: ``pytest tests/unit/inference/test_server.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Overloaded(RuntimeError):
    """More sequences than ``max_pending`` would be in flight; retry later."""


class EngineFailed(RuntimeError):
    """The engine raised while stepping; the request cannot finish."""


@dataclass
class Handle:
    """One engine sequence as seen from the event loop."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: Any
    group: Group
    finished: bool = False
    finish_reason: str | None = None
    completion: Any = None  # the engine's ``Completion`` once finished (text, cached prompt tokens)


class Group:
    """The sequences of one HTTP request (``n`` choices, or several prompts), read together:
    ``async for index, step_output in group`` until every one has finished; an engine
    error or an abort is raised from the iteration."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handles: list[Handle] = []

    @property
    def finished(self) -> bool:
        return all(h.finished for h in self.handles)

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, Any]:
        if self.finished:
            raise StopAsyncIteration
        h, item = await self.queue.get()
        if isinstance(item, BaseException):
            h.finished = True
            raise item
        if item.finished:
            h.finished, h.finish_reason = True, item.finish_reason
        return h.index, item


class EngineLoop:
    def __init__(self, engine: Any, max_pending: int = 256, idle_wait: float = 0.05):
        self.engine = engine
        self.max_pending = max_pending
        self.idle_wait = idle_wait
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Handle] = {}  # engine thread only
        self._pending = 0  # admitted and unfinished; guarded by _lock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.counters = {"admitted": 0, "rejected": 0, "finished": 0, "aborted": 0, "failed": 0,
                         "steps": 0, "generated_tokens": 0}
        self.error: str | None = None

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def pending(self) -> int:
        return self._pending

    def full(self) -> bool:
        """Whether no slot is free (counted as a rejection): a cheap check before any parsing."""
        if self._pending < self.max_pending:
            return False
        with self._lock:
            self.counters["rejected"] += 1
        return True

    def reserve(self, n: int) -> None:
        """Admit ``n`` sequences or raise ``Overloaded``; call before any expensive work."""
        with self._lock:
            if self._pending + n > self.max_pending:
                self.counters["rejected"] += 1
                raise Overloaded(f"{self._pending} sequences in flight, limit {self.max_pending}")
            self._pending += n
            self.counters["admitted"] += n

    def release(self, n: int) -> None:
        """Give back reserved slots that were never submitted (e.g. the request was invalid)."""
        with self._lock:
            self._pending -= n

    def submit(self, seqs: list[tuple[list[int], Any]]) -> Group:
        """Queue ``(prompt_token_ids, params)`` sequences whose slots were ``reserve``d;
        call from the event loop that will read the returned group."""
        group = Group(asyncio.get_running_loop())
        for i, (ids, params) in enumerate(seqs):
            group.handles.append(Handle(i, f"req-{uuid.uuid4().hex}", ids, params, group))
        # one command per group: its sequences enter the engine between the same two steps
        self._inbox.put(("add", list(group.handles)))
        return group

    def abort(self, group: Group) -> None:
        """Abort every unfinished sequence of ``group`` (the client went away)."""
        for h in group.handles:
            if not h.finished:
                h.finished = True
                self._inbox.put(("abort", h.request_id))

    async def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn()`` on the engine thread between two steps and return its result."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", (fn, fut)))
        return await asyncio.wait_for(fut, timeout)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_unfinished())
            if self.engine.has_unfinished():
                self._step()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=self.idle_wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            kind, arg = cmd
            if kind == "add":
                for h in arg:
                    self._add(h)
            elif kind == "abort":
                self._abort(arg)
            else:
                self._call(*arg)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, h: Handle) -> None:
        try:
            self.engine.add_request(h.prompt_token_ids, h.params, request_id=h.request_id)
        except Exception as e:  # noqa: BLE001 - the engine's ValueError names the limit
            self._finish(h, [e])
            return
        self._live[h.request_id] = h

    def _abort(self, request_id: str) -> None:
        h = self._live.get(request_id)
        if h is None:
            return  # finished before the abort arrived
        self.engine.abort(request_id)
        self._pop_completion(request_id)  # the engine keeps finished requests until read
        self.counters["aborted"] += 1
        del self._live[request_id]
        self._release_one()  # the reader stopped listening when it asked for the abort

    def _call(self, fn: Callable[[], Any], fut: asyncio.Future) -> None:
        try:
            result, exc = fn(), None
        except Exception as e:  # noqa: BLE001 - handed to the caller
            result, exc = None, e
        _post(fut.get_loop(), _resolve, fut, result, exc)

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the live requests, keep serving
            self.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            for rid, h in list(self._live.items()):
                with contextlib.suppress(Exception):  # free its blocks if the engine still can
                    self.engine.abort(rid)
                self.counters["failed"] += 1
                self._finish(h, [EngineFailed(self.error)])
            return
        self.counters["steps"] += 1
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Handle, Any]]] = {}
        for out in outs:
            h = self._live.get(out.request_id)
            if h is None:
                continue
            self.counters["generated_tokens"] += len(out.new_token_ids)
            if out.finished:
                h.completion = self._pop_completion(out.request_id)
                del self._live[out.request_id]
                self._release_one()
                self.counters["finished"] += 1
            by_loop.setdefault(h.group.loop, []).append((h, out))
        for loop, items in by_loop.items():
            _post(loop, _deliver, items)

    def _pop_completion(self, request_id: str) -> Any:
        try:
            return self.engine.completion(request_id)
        except KeyError:
            return None

    def _finish(self, h: Handle, items: list[Any]) -> None:
        self._live.pop(h.request_id, None)
        self._release_one()
        _post(h.group.loop, _deliver, [(h, x) for x in items])

    def _release_one(self) -> None:
        with self._lock:
            self._pending -= 1


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop``; a reader whose event loop has closed is simply gone."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _deliver(items: list[tuple[Handle, Any]]) -> None:
    for h, x in items:
        h.group.queue.put_nowait((h, x))


def _resolve(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
