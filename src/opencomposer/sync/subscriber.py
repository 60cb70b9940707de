"""The inference side of weight sync: follow a store and apply new versions in flight.

    sub = WeightSubscriber(open_store("s3://bucket/run-7"))
    sub.poll(engine)                       # apply what is new, between two engine steps
    WeightFollower(sub, engine, every_s=1.0).start()   # the same in a background thread

A target is anything with ``policy_version``, ``weight_views(shapes)`` (name -> the tensor
to write) and ``edit_weights(fn, version)`` (run ``fn`` between two steps): the engine
(``inference.engine.Engine``). A poll lists the store, picks the newest complete version,
and plans a chain to it: the deltas after the version it holds, or, when it holds none,
holds another timeline's, or a version in between is gone, the newest full snapshot that
reaches it. Downloads and decompression happen before the engine is paused; the pause
itself is the scatter / xor / copy of each changed tensor, and running sequences continue
on the new weights. Every tensor the chain touched is then checked against the
publisher's checksum; a mismatch (the engine held other weights than the chain assumed)
reloads from a full snapshot.

Test: ``pytest tests/unit/sync/test_weights.py``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import torch

from opencomposer.sync import codec
from opencomposer.sync.layout import FORMAT, Entry, scan

log = logging.getLogger(__name__)


class SyncError(RuntimeError):
    """The store holds nothing this follower can reach, or what it applied does not check out."""


class ChecksumMismatch(SyncError):
    """Applied tensors differ from the publisher's: the deltas started from other weights."""

    def __init__(self, message: str, from_full: bool):
        super().__init__(message)
        self.from_full = from_full


class WeightSubscriber:
    def __init__(self, store, device: torch.device | str | None = None, verify: bool = True):
        self.store, self.device, self.verify = store, device, verify
        self.timeline: str | None = None
        self.version: int | None = None  # the version the target holds, as this follower set it
        self.counts = {"versions_applied": 0, "polls": 0, "full_loads": 0, "recoveries": 0, "bytes_read": 0}
        self.last: dict[str, Any] = {}
        self._staging = codec.Staging()  # pinned host memory for the deltas' way to the GPU
        self.newest: int | None = None  # the newest complete version the last poll saw

    # ------------------------------------------------------------------ planning

    def _plan(self, done: list[Entry], goal: Entry, from_full: bool) -> list[Entry]:
        line = {e.version: e for e in done if e.timeline == goal.timeline}
        if not from_full and self.timeline == goal.timeline and self.version is not None:
            steps = [line.get(v) for v in range(self.version + 1, goal.version + 1)]
            if all(steps):
                return steps
        for f in sorted((e for e in line.values() if e.kind == "full" and e.version <= goal.version), reverse=True):
            steps = [line.get(v) for v in range(f.version + 1, goal.version + 1)]
            if all(steps):
                return [f, *steps]
        raise SyncError(f"{self.store.uri}: no full snapshot of timeline {goal.timeline} reaches version "
                        f"{goal.version} through complete versions")

    def _load(self, entry: Entry, device) -> list[codec.Patch]:
        patches = []
        for rank in range(entry.world):
            try:
                manifest = json.loads(self.store.get(entry.manifest(rank)))
                blob = self.store.get(entry.blob(rank))
            except KeyError as e:  # deleted under us (the publisher's clean-up): replan next poll
                raise SyncError(f"version {entry.version} went away while reading it: {e}") from None
            if manifest.get("format") != FORMAT:
                raise SyncError(f"{self.store.uri}/{entry.manifest(rank)}: format {manifest.get('format')!r}, "
                                f"expected {FORMAT!r}")
            if len(blob) != manifest["blob_bytes"]:
                raise SyncError(f"{self.store.uri}/{entry.blob(rank)}: {len(blob)} bytes, manifest says "
                                f"{manifest['blob_bytes']}")
            self.counts["bytes_read"] += len(blob)
            view, items = memoryview(blob), []
            for name, meta in manifest["tensors"].items():
                at, parts = meta["offset"], []
                for frames in meta["parts"]:
                    parts.append(view[at:at + sum(frames)])
                    at += sum(frames)
                items.append((name, meta, parts))
            try:
                patches += codec.decode_all(items, device, self._staging)
            except codec.CodecError as e:
                raise SyncError(f"{self.store.uri}/{entry.blob(rank)}: {e}") from None
        return patches

    # ------------------------------------------------------------------ poll

    def latest(self) -> Entry | None:
        done, _ = scan(self.store.list())
        return max(done, key=_newest) if done else None

    def poll(self, target) -> dict[str, Any] | None:
        """Bring ``target`` to the newest complete version; None when it already holds it."""
        self.counts["polls"] += 1
        done, _ = scan(self.store.list())
        if not done:
            return None
        goal = max(done, key=_newest)
        self.newest = goal.version
        if target.policy_version != self.version:  # someone else changed the weights
            self.timeline = self.version = None
        if (goal.timeline, goal.version) == (self.timeline, self.version):
            return None
        if goal.timeline == self.timeline and self.version is not None and goal.version < self.version:
            return None  # an older version of our own timeline: nothing newer yet
        try:
            return self._apply(target, done, goal, from_full=False)
        except ChecksumMismatch as e:
            if e.from_full:  # already from a full snapshot: nothing better to reload from
                raise
            log.warning("weight sync: %s; reloading from a full snapshot", e)
            self.counts["recoveries"] += 1
            return self._apply(target, done, goal, from_full=True)

    def _apply(self, target, done: list[Entry], goal: Entry, from_full: bool) -> dict[str, Any]:
        chain = self._plan(done, goal, from_full or self.timeline is None)
        t0 = time.perf_counter()
        bytes0 = self.counts["bytes_read"]
        device = self.device or getattr(target, "device", None) or "cpu"
        # a full snapshot stays on the host and is copied tensor by tensor (no second model
        # on the device); deltas are small and go to the device before the pause
        patches = [p for entry in chain for p in self._load(entry, "cpu" if entry.kind == "full" else device)]
        try:
            codec.check(patches)
        except codec.CodecError as e:
            raise SyncError(f"{self.store.uri}: version {goal.version}: {e}") from None
        views = target.weight_views({p.name: p.shape for p in patches})
        # tensors the target does not hold separately (a tied lm_head) are not in ``views``;
        # a dtype the engine does not run in is refused before any weight changes
        wrong = [(p.name, p.dtype, views[p.name].dtype) for p in patches
                 if p.name in views and views[p.name].dtype != p.dtype]
        if wrong:
            name, sent, held = wrong[0]
            raise SyncError(f"{self.store.uri}: version {goal.version} is {sent} (e.g. {name}) but the engine runs "
                            f"in {held}: publish in the engine's dtype ([sync] dtype) or serve with --dtype to match")
        t1 = time.perf_counter()

        def edit() -> None:
            for p in patches:
                if p.name in views:
                    codec.apply(p, views[p.name])
        try:
            target.edit_weights(edit, goal.version)
        except codec.CodecError as e:
            self.timeline = self.version = None
            raise SyncError(str(e)) from None
        t2 = time.perf_counter()
        bad = []
        if self.verify:
            final = {p.name: p.checksum for p in patches if p.name in views}  # later patches overwrite
            touched = {p.name for p in patches if p.encoding != "same" and p.name in views}
            names = sorted(touched)
            bad = [n for n, got in zip(names, codec.checksums([views[n] for n in names])) if got != tuple(final[n])]
        if bad:
            self.timeline = self.version = None
            raise ChecksumMismatch(f"checksum of {len(bad)} tensors differs after applying version {goal.version} "
                                   f"(e.g. {bad[:3]}): the target did not hold the version the deltas start "
                                   "from", chain[0].kind == "full")
        self.counts["versions_applied"] += len(chain)
        self.counts["full_loads"] += sum(e.kind == "full" for e in chain)
        self.last = {"version": goal.version, "timeline": goal.timeline, "chain": [e.version for e in chain],
                     "from_full": chain[0].kind == "full", "bytes": self.counts["bytes_read"] - bytes0,
                     "changed_tensors": sum(p.encoding != "same" for p in patches),
                     "fetch_decode_s": t1 - t0, "pause_s": t2 - t1, "verify_s": time.perf_counter() - t2}
        self.timeline, self.version = goal.timeline, goal.version  # last: readers see a whole record
        return self.last


def _newest(e: Entry) -> tuple[int, bool]:
    return e.version, e.kind == "full"


class WeightFollower:
    """Polls a ``WeightSubscriber`` every ``every_s`` seconds in a daemon thread; an error is
    logged and counted (the engine keeps serving its current weights), never raised."""

    def __init__(self, subscriber: WeightSubscriber, target, every_s: float = 1.0):
        self.sub, self.target, self.every_s = subscriber, target, every_s
        self.errors, self.last_error = 0, ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-follower", daemon=True)

    def start(self) -> WeightFollower:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                res = self.sub.poll(self.target)
                if res:
                    log.info("weight sync: version %s applied (%s)", res["version"], res)
            except Exception as e:  # noqa: BLE001 - a follower must outlive a bad version
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("weight sync: %s", self.last_error)
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def stats(self) -> dict[str, Any]:
        behind = None if self.sub.newest is None or self.sub.version is None else self.sub.newest - self.sub.version
        return {"store": self.sub.store.uri, "timeline": self.sub.timeline, "version": self.sub.version,
                "newest_in_store": self.sub.newest, "versions_behind": behind, **self.sub.counts, "errors": self.errors, "last_error": self.last_error, "last": self.sub.last}
