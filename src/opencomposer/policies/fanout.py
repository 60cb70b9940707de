"""``FanoutPolicy``: several rollout engines behind the one interface episodes use; the K
rollouts of a group run on one engine, the least-loaded when the group's first episode starts.

    def build(i):  # engine i: its own copy of the weights, on its own device
        return BatchedPolicy(EnginePolicy(Engine(model, tok, device=f"cuda:{i}"), temperature=1.0))
    policy = FanoutPolicy([build(0), build(1)], ["engine 0 (cuda:0)", "engine 1 (cuda:1)"], rebuild=build)
    rollouts = collect_rollouts(tasks, k=4, policy=policy, ...)   # each episode: policy.episode(group=...)
    policy.each(lambda p: p.policy.update_weights(state, 3), "update its weights to version 3")
    policy.figures()          # running totals per engine: engine_episodes_0, engine_requests_1, ...
    policy.revive()           # a fresh engine (``build(i)``) in place of each one that failed
    policy.close()

``rl/engines.py`` builds one from ``[rollout] engines`` / ``engine_devices`` / ``base_urls``
(``docs/scaling.md``, "Several rollout engines").

Dispatch. ``episode(group=key)`` picks the engine of the group ``key`` when the group has one,
else the engine with the fewest live episodes (ties: the lowest index), and remembers it for the
group (the last ``max_groups`` groups), so a group's shared prompt prefix is prefilled and cached
on one engine. It yields an ``EngineSession``: the episode's policy, whose turns go to that
engine. ``act`` outside an episode goes to the least-loaded engine. ``collect_rollouts`` gives
each group a key of its own (``episode/run.py``).

Failure. A failed engine step (``EngineStepError`` from ``BatchedPolicy``; batch mode: a failed
batch, e.g. a server that stopped answering) takes that engine out of dispatch, loudly (stderr
and a ``RuntimeWarning``), and closes it. The episodes whose requests were in that step are
void: leaving ``episode()`` raises ``EngineFailed``, so ``collect_rollouts`` records a failed
rollout (no result, no samples: nothing is trained on them). The other episodes of its groups,
between two turns at the time, continue on the least-loaded engine up (their group moves with
them; so does a turn that reached the failed engine after it closed, nothing of it run); their
earlier tokens keep their version tags. With ``rebuild`` (built-in engines: a
fresh engine on the current weights) ``revive`` puts a new engine in its place; the RL actor
calls it at each weight sync, when the trainer's tensors are still. Without ``rebuild``
(servers), or when the rebuild fails, the engine stays out for the rest of the run. With no
engine up, dispatch raises ``EngineFailed`` naming every engine's last error.

Figures. ``stats`` sums the engines' ``BatchedPolicy.stats`` (a replaced engine's totals kept,
so a step's deltas stay right): ``generate_seconds`` is engine-seconds, each engine's wall time
with a request in it, summed (N engines busy together count N seconds a second); ``requests``,
``batches`` and ``sequence_steps`` are sums, so ``mean_running`` is sequences per engine step.
``figures`` gives each engine's own episodes, requests, generate seconds and failures;
``engine_counts`` sums the built-in engines' ``Engine.stats`` counters; ``versions`` is the
policy version each engine runs, and ``policy_version`` the oldest of them.

Test: ``pytest tests/unit/policies/test_fanout.py``; with episodes: ``pytest
tests/unit/episode/test_rollout.py -k engines``; in an RL run: ``pytest tests/integration/test_rl_engines.py``.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Self

from opencomposer.policies.batched import BatchedPolicy, EngineStepError, PolicyClosed
from opencomposer.protocols import Message, PolicyOutput


class EngineFailed(RuntimeError):
    """The engine an episode ran on failed under it, or no engine is up: the episode is void."""


class EngineError(RuntimeError):
    """An operation on one engine (a weight update, a wait for a version) failed; names the engine."""


@dataclass
class _Slot:
    """One engine's place in the fan-out, across the engines that fill it."""

    index: int
    label: str  # "engine 1 (cuda:1)", "engine 0 (http://gpu-7:8000/v1)"
    policy: BatchedPolicy | None  # None: out of dispatch (failed)
    revivable: bool  # out: a rebuild may put a fresh engine here
    live: int = 0  # episodes dispatched here, running
    episodes: int = 0  # episodes started here
    failures: int = 0
    error: str = ""  # the last failure
    failed: BatchedPolicy | None = None  # the failed engine, read for its totals until revived
    closing: threading.Thread | None = None
    done: dict[str, float] = field(default_factory=dict)  # the totals of engines replaced here
    done_engine: dict[str, float] = field(default_factory=dict)


def _add(into: dict[str, float], more: dict[str, float]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0.0) + v


def _engine_counts(p: BatchedPolicy | None) -> dict[str, float]:
    """A built-in engine's running counters (``BatchedPolicy.engine_counts``; {} otherwise)."""
    return p.engine_counts() if p is not None else {}


class EngineSession:
    """One episode's policy (what ``FanoutPolicy.episode`` yields): its turns go to its group's
    engine; ``engine`` is that engine's index, ``failure`` says how its engine failed under it."""

    def __init__(self, fanout: FanoutPolicy, group: Hashable | None):
        self.fanout, self.group, self.name = fanout, group, fanout.name
        self.slot: _Slot | None = None
        self.registered: BatchedPolicy | None = None  # the engine's policy that counts it live
        self.failure = ""

    @property
    def engine(self) -> int | None:
        return self.slot.index if self.slot is not None else None

    @property
    def tokenizer(self) -> Any:
        return self.fanout.tokenizer

    @property
    def policy_version(self) -> int:
        policy = self.slot.policy if self.slot is not None else None
        return policy.policy_version if policy is not None else self.fanout.policy_version

    def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> PolicyOutput:
        while True:
            try:
                slot, policy = self.fanout._serve(self)
            except EngineFailed as e:
                self.failure = str(e)
                raise
            try:
                return policy.act(messages, tools)
            except PolicyClosed:
                if slot.policy is policy:  # the fan-out itself is closing
                    raise
                # taken out (failed) between choosing it and queueing the request: nothing of it
                # ran, so the turn goes to the engine up that takes its group now
            except Exception as e:
                if isinstance(e, EngineStepError):
                    self.fanout._take_out(slot, policy, e)
                if slot.policy is not policy:  # its engine failed under it (in this request's step or another's)
                    self.failure = f"{slot.label} failed: {type(e).__name__}: {e}"
                raise


class FanoutPolicy:
    """Implements the batched-policy interface of the episodes over several ``BatchedPolicy``
    engines; see the module docstring. ``labels`` name the engines in errors and warnings;
    ``rebuild(i)`` makes a fresh engine i (None: a failed engine is dropped for good)."""

    def __init__(self, policies: list[BatchedPolicy], labels: list[str] | None = None,
                 rebuild: Callable[[int], BatchedPolicy] | None = None, max_groups: int = 4096):
        if not policies:
            raise ValueError("FanoutPolicy needs at least one engine")
        labels = labels or [f"engine {i}" for i in range(len(policies))]
        if len(labels) != len(policies):
            raise ValueError(f"{len(labels)} labels for {len(policies)} engines")
        self.slots = [_Slot(i, label, p, revivable=rebuild is not None)
                      for i, (label, p) in enumerate(zip(labels, policies))]
        self.name, self.tokenizer = policies[0].name, policies[0].tokenizer
        self.rebuild, self.max_groups = rebuild, max_groups
        self._groups: OrderedDict[Hashable, _Slot] = OrderedDict()  # group -> its engine, oldest first
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ the policy interface

    def engines(self) -> list[BatchedPolicy]:
        """The engines up, in order."""
        return [s.policy for s in self.slots if s.policy is not None]

    @property
    def up(self) -> int:
        return sum(s.policy is not None for s in self.slots)

    @property
    def policy_version(self) -> int:
        """The oldest version any engine up runs."""
        engines = self.engines()
        if not engines:
            raise self._none_up()
        return min(p.policy_version for p in engines)

    @property
    def max_batch(self) -> int:
        return sum(p.max_batch for p in self.engines())

    @property
    def stats(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for s in self.slots:
            _add(total, s.done)
            for p in (s.policy, s.failed):
                if p is not None:
                    _add(total, p.stats)
        return total

    @property
    def mean_running(self) -> float:
        st = self.stats
        return st.get("sequence_steps", 0) / st["batches"] if st.get("batches") else 0.0

    def engine_counts(self) -> dict[str, float]:
        """The built-in engines' ``Engine.counts`` counters, summed (replaced engines' kept); {} without any."""
        total: dict[str, float] = {}
        for s in self.slots:
            _add(total, s.done_engine)
            for p in (s.policy, s.failed):
                _add(total, _engine_counts(p))
        return total

    def figures(self) -> dict[str, float]:
        """Each engine's running totals, for a step's row (its deltas): ``engine_episodes_<i>``,
        ``engine_requests_<i>``, ``engine_generate_s_<i>``, ``engine_failures_<i>``."""
        out: dict[str, float] = {}
        for s in self.slots:
            st = dict(s.done)
            for p in (s.policy, s.failed):
                if p is not None:
                    _add(st, p.stats)
            i = s.index
            out.update({f"engine_episodes_{i}": float(s.episodes), f"engine_requests_{i}": st.get("requests", 0.0),
                        f"engine_generate_s_{i}": st.get("generate_seconds", 0.0),
                        f"engine_failures_{i}": float(s.failures)})
        return out

    def versions(self) -> dict[int, int]:
        """The policy version each engine up runs, by index."""
        return {s.index: s.policy.policy_version for s in self.slots if s.policy is not None}

    def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> PolicyOutput:
        """One turn outside an episode, on the least-loaded engine."""
        with self.episode() as session:
            return session.act(messages, tools)

    @contextmanager
    def episode(self, group: Hashable | None = None) -> Iterator[EngineSession]:
        """One episode of ``group`` (None: a group of its own), live on its engine while inside;
        yields its policy. Raises ``EngineFailed`` on leaving when its engine failed under it."""
        session = EngineSession(self, group)
        with self._lock:
            if self._closed:
                raise RuntimeError("FanoutPolicy is closed; no engine will answer")
            self._place(session, self._slot_for(group))
            session.slot.episodes += 1
        try:
            yield session
        finally:
            with self._lock:
                session.slot.live -= 1
                registered, session.registered = session.registered, None
            if registered is not None:
                registered.unregister()
        if session.failure:
            raise EngineFailed(f"the episode's engine failed under it: {session.failure}")

    # ------------------------------------------------------------------ dispatch (under the lock)

    def _slot_for(self, group: Hashable | None) -> _Slot:
        slot = self._groups.get(group) if group is not None else None
        if slot is not None and slot.policy is not None:
            self._groups.move_to_end(group)
            return slot
        up = [s for s in self.slots if s.policy is not None]
        if not up:
            raise self._none_up()
        slot = min(up, key=lambda s: (s.live, s.index))
        if group is not None:
            self._groups[group] = slot
            self._groups.move_to_end(group)
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)
        return slot

    def _place(self, session: EngineSession, slot: _Slot) -> None:
        """``session`` live on ``slot`` (moved from its old one, if any)."""
        if session.slot is not None:
            session.slot.live -= 1
        session.slot = slot
        slot.live += 1
        self._register(session)

    @staticmethod
    def _register(session: EngineSession) -> None:
        """Count the session live in its engine's ``BatchedPolicy`` (batch mode waits for live episodes)."""
        policy = session.slot.policy
        if session.registered is not policy:
            if session.registered is not None:
                session.registered.unregister()
            policy.register()
            session.registered = policy

    def _serve(self, session: EngineSession) -> tuple[_Slot, BatchedPolicy]:
        """The engine for the session's next turn: its own, or (that one out) the least-loaded up."""
        with self._lock:
            if session.slot.policy is None:
                self._place(session, self._slot_for(session.group))
            else:
                self._register(session)  # its engine may have been replaced since its last turn
            return session.slot, session.slot.policy

    def _none_up(self) -> EngineFailed:
        return EngineFailed("no rollout engine is up: " + "; ".join(f"{s.label}: {s.error or 'closed'}"
                                                                     for s in self.slots))

    # ------------------------------------------------------------------ failure

    def _take_out(self, slot: _Slot, policy: BatchedPolicy, error: BaseException) -> None:
        """``policy``'s step failed: out of dispatch, closed (once, whoever of its episodes reports it)."""
        with self._lock:
            if slot.policy is not policy:
                return
            slot.policy, slot.failed = None, policy
            slot.failures += 1
            cause = error.__cause__ or error
            slot.error = f"{type(cause).__name__}: {cause}"
            slot.revivable = slot.revivable and not self._closed
        after = ("a fresh engine on the current weights replaces it at the next weight sync" if slot.revivable
                 else "it is dropped from dispatch for the rest of the run")
        _warn(f"rollout {slot.label} failed: {slot.error}. The episodes in its step are void (failed rollouts, "
              f"not trained on); its other episodes continue on the other engines; {after}")
        # closing drains what is queued there; not on the episode's thread, which may return now
        slot.closing = threading.Thread(target=policy.close, name=f"close-{slot.label}", daemon=True)
        slot.closing.start()

    def revive(self) -> list[int]:
        """A fresh engine (``rebuild(i)``) in place of each one that failed; the indices revived.
        A rebuild that raises leaves that engine out for good (warned). Call it when the weights
        the rebuild reads are still (the RL actor: at a weight sync). ``EngineFailed`` when
        no engine is up afterwards."""
        revived = []
        for slot in self.slots:
            with self._lock:
                if slot.policy is not None or not slot.revivable or self._closed:
                    continue
            self._retire(slot)
            try:
                fresh = self.rebuild(slot.index)
            except Exception as e:  # noqa: BLE001 -- whatever it is, the engine stays out, warned
                slot.revivable, slot.error = False, f"rebuild failed: {type(e).__name__}: {e}"
                _warn(f"rollout {slot.label} could not be rebuilt ({slot.error}); it is dropped from dispatch "
                      "for the rest of the run")
                continue
            with self._lock:
                slot.policy = fresh
            revived.append(slot.index)
        if not self.up:
            raise self._none_up()
        return revived

    def _retire(self, slot: _Slot) -> None:
        """Fold a failed engine's totals into the slot's and let it go (its memory with it)."""
        if slot.closing is not None:
            slot.closing.join()
            slot.closing = None
        failed, slot.failed = slot.failed, None
        if failed is not None:
            _add(slot.done, failed.stats)
            _add(slot.done_engine, _engine_counts(failed))

    def each(self, fn: Callable[[BatchedPolicy], Any], doing: str, replace_failed: bool = False) -> None:
        """``fn`` on every engine up, in order (``doing``: what it does, for the error);
        ``EngineError`` names the engine that failed. ``replace_failed`` (engines that can be
        rebuilt): an engine whose ``fn`` fails is taken out (warned) and rebuilt at once
        (``revive``; the fresh one starts on the weights of now), and the run goes on."""
        for slot in self.slots:
            policy = slot.policy
            if policy is None:
                continue
            try:
                fn(policy)
            except Exception as e:
                if not (replace_failed and slot.revivable and self.rebuild is not None):
                    raise EngineError(f"rollout {slot.label}: could not {doing}: {type(e).__name__}: {e}") from e
                self._take_out(slot, policy, EngineError(f"could not {doing}: {type(e).__name__}: {e}"))
        if replace_failed:
            self.revive()

    def close(self) -> None:
        """Close every engine (queued requests finish first); episodes still running then fail."""
        with self._lock:
            self._closed = True
        for slot in self.slots:
            if slot.policy is not None:
                slot.policy.close()
            if slot.closing is not None:
                slot.closing.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def each_engine(policy: BatchedPolicy | FanoutPolicy, fn: Callable[[BatchedPolicy], Any], doing: str) -> None:
    """``fn`` on every engine of ``policy``: each of a ``FanoutPolicy`` (errors name the engine),
    or the one ``BatchedPolicy`` (its errors as they are)."""
    if isinstance(policy, FanoutPolicy):
        policy.each(fn, doing)
    else:
        fn(policy)


def _warn(msg: str) -> None:
    print(f"WARNING: {msg}", file=sys.stderr, flush=True)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
