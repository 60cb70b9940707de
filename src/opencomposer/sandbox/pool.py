"""``SandboxPool``: pre-warmed sandboxes per base image, handed out under asyncio.

    pool = SandboxPool(backend="namespace", warm=2, max_sandboxes=16)
    async with pool.acquire(spec) as sb:      # an idle, health-checked sandbox of spec
        await asyncio.to_thread(sb.exec, "pytest -q")
    await pool.close()                        # closes every sandbox it made, idle or not

- Keyed by the whole ``SandboxSpec`` (base image, env, pythonpath, network, env vars):
  a sandbox is only reused for the very spec it was made for.
- ``warm`` idle sandboxes per spec are kept ready: after an acquire the pool starts
  replacements in the background, so the next acquire does not pay creation time.
- ``max_sandboxes`` caps sandboxes alive at once (idle + in use + being made); an
  acquire beyond it waits until one is released (or evicts an idle one of another spec).
- Health check on the way out: a quick ``exec`` (``true``) that must exit 0 within
  ``health_timeout``; a sandbox that fails it is closed and replaced. It costs one
  exec (~1 ms ``local``, a few ms ``namespace``, ~0.5 s ``gvisor``/``docker``, which
  start a process tree per exec): ``health_check=False`` skips it where that matters
  more than catching a broken sandbox before use. Sandboxes with a ``start()`` (the
  ``namespace`` exec server) are started when made, so warm ones are ready.
- On release the sandbox is ``reset()`` to its initial state; one whose reset fails
  (or whose ``async with`` body raised, if ``discard_on_error``) is closed instead.
- ``close()`` cancels warming, closes idle sandboxes at once and in-use ones as they
  come back; nothing the pool made outlives it.

Sandboxes are synchronous objects: creation, health checks, resets and closes run in
worker threads (``asyncio.to_thread``) so the event loop never blocks on them.
Threaded callers (``rl/rollout``'s episode threads) use ``BlockingSandboxPool``, which
runs the pool on a loop of its own: ``with pool.lease(spec) as sb: ...``.

Test: ``pytest tests/unit/sandbox/test_pool.py -q``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import defaultdict, deque
from typing import Any, AsyncIterator, Callable, Iterator

from opencomposer.protocols import Sandbox, SandboxSpec


def spec_key(spec: SandboxSpec) -> tuple:
    """A hashable identity of ``spec`` (``SandboxSpec`` itself is a mutable dataclass)."""
    return (
        os.path.realpath(spec.base_dir), os.path.realpath(spec.env_dir) if spec.env_dir else None,
        tuple(spec.pythonpath), bool(spec.network), tuple(sorted(spec.extra_env.items())),
    )


class PoolClosed(RuntimeError):
    """``acquire`` on a pool that was closed."""


class SandboxPool:
    """Pre-warmed sandboxes per ``SandboxSpec`` with a global cap; see the module doc."""

    def __init__(
        self,
        backend: str = "local",
        *,
        warm: int = 1,
        max_sandboxes: int = 8,
        health_timeout: float = 10.0,
        health_check: bool = True,
        discard_on_error: bool = True,
        factory: Callable[[SandboxSpec], Sandbox] | None = None,
        **backend_kwargs: Any,
    ):
        if warm < 0:
            raise ValueError(f"SandboxPool warm must be >= 0, got {warm}")
        if max_sandboxes < 1:
            raise ValueError(f"SandboxPool max_sandboxes must be >= 1, got {max_sandboxes}")
        if factory is None:
            from opencomposer.sandbox import make_sandbox

            def factory(spec: SandboxSpec) -> Sandbox:
                return make_sandbox(spec, backend=backend, **backend_kwargs)

        self.backend = backend
        self.warm = warm
        self.max_sandboxes = max_sandboxes
        self.health_timeout = health_timeout
        self.health_check = health_check
        self.discard_on_error = discard_on_error
        self._factory = factory
        self._idle: dict[tuple, deque[Sandbox]] = defaultdict(deque)
        self._in_use: set[int] = set()  # ids of sandboxes handed out
        self._live: dict[int, Sandbox] = {}  # every sandbox made and not yet closed
        self._pending = 0  # creations under way (they count against the cap)
        self._pending_for: dict[tuple, int] = {}  # background creations per spec
        self._warming: set[asyncio.Task] = set()
        self._cond: asyncio.Condition | None = None
        self._closed = False
        self.stats = {"created": 0, "reused": 0, "unhealthy": 0, "closed": 0, "waited": 0}

    # ------------------------------------------------------------------ public

    @contextlib.asynccontextmanager
    async def acquire(self, spec: SandboxSpec) -> AsyncIterator[Sandbox]:
        """An idle healthy sandbox of ``spec`` (made if none), reset and kept on exit."""
        sb = await self._take(spec)
        failed = False
        try:
            yield sb
        except BaseException:
            failed = True
            raise
        finally:
            await asyncio.shield(self._give_back(spec, sb, failed and self.discard_on_error))

    async def prewarm(self, spec: SandboxSpec, n: int | None = None) -> None:
        """Make idle sandboxes of ``spec`` until ``n`` (default ``warm``) are ready; waits."""
        key = spec_key(spec)
        want = self.warm if n is None else n
        while not self._closed and len(self._idle[key]) < want and self._room():
            await self._add_idle(spec)

    @property
    def size(self) -> int:
        """Sandboxes alive (idle + in use)."""
        return len(self._live)

    def idle(self, spec: SandboxSpec | None = None) -> int:
        if spec is None:
            return sum(len(q) for q in self._idle.values())
        return len(self._idle.get(spec_key(spec), ()))

    async def close(self) -> None:
        """Stop warming, close idle sandboxes now and in-use ones when they come back."""
        self._closed = True
        for t in list(self._warming):
            t.cancel()
        if self._warming:
            await asyncio.gather(*self._warming, return_exceptions=True)
        self._idle.clear()
        # idle ones, and any a cancelled acquire made but never handed out
        orphans = [sb for key, sb in self._live.items() if key not in self._in_use]
        await asyncio.gather(*(self._close_sb(sb) for sb in orphans))
        async with self._condition():
            self._condition().notify_all()

    async def __aenter__(self) -> "SandboxPool":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ internals

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:  # made lazily: it binds to the running loop
            self._cond = asyncio.Condition()
        return self._cond

    def _room(self) -> bool:
        return len(self._live) + self._pending < self.max_sandboxes

    async def _take(self, spec: SandboxSpec) -> Sandbox:
        key = spec_key(spec)
        cond = self._condition()
        while True:
            if self._closed:
                raise PoolClosed("sandbox pool is closed")
            async with cond:
                sb = self._idle[key].popleft() if self._idle[key] else None
                make = sb is None and self._room()
                if make:
                    self._pending += 1
                elif sb is None and not await self._evict_other(key):
                    self.stats["waited"] += 1
                    await cond.wait()
                    continue
                elif sb is None:
                    continue  # an idle sandbox of another spec was closed: room now
            if make:
                try:
                    sb = await self._create(spec)
                except BaseException:
                    self._pending -= 1
                    async with cond:
                        cond.notify_all()  # the room it held is free again
                    raise
                self._pending -= 1
                self._in_use.add(id(sb))
                self._schedule_warm(spec)
                return sb
            if await self._healthy(sb):
                self.stats["reused"] += 1
                self._in_use.add(id(sb))
                self._schedule_warm(spec)
                return sb
            self.stats["unhealthy"] += 1
            await self._close_sb(sb)

    async def _evict_other(self, key: tuple) -> bool:
        """Close one idle sandbox of another spec to make room (caller holds the lock)."""
        for other, q in self._idle.items():
            if other != key and q:
                victim = q.popleft()
                await self._close_sb(victim)
                return True
        return False

    async def _create(self, spec: SandboxSpec) -> Sandbox:
        sb = await asyncio.to_thread(self._factory, spec)
        self._live[id(sb)] = sb
        if hasattr(sb, "warm"):  # warm means ready: a namespace sandbox's exec server is up
            try:
                await asyncio.to_thread(sb.warm)
            except Exception:
                await self._close_sb(sb)
                raise
        self.stats["created"] += 1
        if self._closed:  # closed while we were making it
            await self._close_sb(sb)
            raise PoolClosed("sandbox pool was closed while a sandbox was being made")
        return sb

    async def _healthy(self, sb: Sandbox) -> bool:
        if not self.health_check:
            return True
        try:
            r = await asyncio.to_thread(sb.exec, "true", self.health_timeout, 1000)
        except Exception:
            return False
        return r.exit_code == 0 and not r.timed_out

    async def _give_back(self, spec: SandboxSpec, sb: Sandbox, discard: bool) -> None:
        self._in_use.discard(id(sb))
        keep = not discard and not self._closed
        if keep:
            try:
                await asyncio.to_thread(sb.reset)
            except Exception:
                keep = False
        if not keep:
            await self._close_sb(sb)
        cond = self._condition()
        async with cond:
            if keep and not self._closed:
                self._idle[spec_key(spec)].append(sb)
            cond.notify_all()

    def _schedule_warm(self, spec: SandboxSpec) -> None:
        if self._closed or self.warm == 0:
            return
        task = asyncio.get_running_loop().create_task(self._warm_up(spec))
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    async def _warm_up(self, spec: SandboxSpec) -> None:
        key = spec_key(spec)
        try:
            while not self._closed and len(self._idle[key]) + self._pending_for.get(key, 0) < self.warm and self._room():
                await self._add_idle(spec)
        except Exception:  # a failed background creation must not kill the loop; acquire retries
            pass

    async def _add_idle(self, spec: SandboxSpec) -> None:
        key = spec_key(spec)
        self._pending += 1
        self._pending_for[key] = self._pending_for.get(key, 0) + 1
        try:
            sb = await self._create(spec)
        finally:
            self._pending -= 1
            self._pending_for[key] -= 1
        cond = self._condition()
        async with cond:
            self._idle[key].append(sb)
            cond.notify_all()

    async def _close_sb(self, sb: Sandbox) -> None:
        if self._live.pop(id(sb), None) is None:
            return
        self.stats["closed"] += 1
        try:
            await asyncio.to_thread(sb.close)
        except Exception:
            pass


class BlockingSandboxPool:
    """A ``SandboxPool`` for threaded callers (``rl/rollout`` runs episodes in threads).

    The pool lives on an event loop in a daemon thread; ``lease`` blocks the calling
    thread until a sandbox is free and gives it back (reset) at the end of the block.

        pool = BlockingSandboxPool(SandboxPool("namespace", warm=4, max_sandboxes=16))
        with pool.lease(task.sandbox_spec()) as sb:   # from any thread
            ...
        pool.close()
    """

    def __init__(self, pool: SandboxPool):
        self.pool = pool
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sandbox-pool", daemon=True)
        self._thread.start()

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @contextlib.contextmanager
    def lease(self, spec: SandboxSpec) -> Iterator[Sandbox]:
        cm = self.pool.acquire(spec)
        sb = self._run(cm.__aenter__())
        try:
            yield sb
        except BaseException as e:
            if not self._run(cm.__aexit__(type(e), e, e.__traceback__)):
                raise
        else:
            self._run(cm.__aexit__(None, None, None))

    def prewarm(self, spec: SandboxSpec, n: int | None = None) -> None:
        self._run(self.pool.prewarm(spec, n))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self.pool.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "BlockingSandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
