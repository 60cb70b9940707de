"""The trainer side of weight sync: publish each new version as the differences from the last.

    pub = WeightPublisher(open_store("s3://bucket/run-7"), dtype=torch.bfloat16)
    stats = pub.publish(model.state_dict(), version=trainer.version)   # after each optimizer step

The first version a publisher writes is a full snapshot (every tensor, compressed), then
one every ``full_every`` versions so a new follower never replays a long chain; the others
hold only what changed since the previous version (``codec``: exact, bit for bit). The
publisher keeps the last published tensors (cast to ``dtype``, the inference engine's
dtype) on their own device to diff against: the comparison and gather run there, and only
the changed elements cross to the host. ``keep_on="cpu"`` keeps that copy in pinned host
memory instead (2 bytes a parameter off the GPU) and copies each tensor over for its diff.

Several training ranks each publish their own tensors (``rank``, ``world``; same
``timeline`` string on every rank): a version is complete when all ranks' parts are in.
Old versions are deleted once two newer full snapshots exist (``keep_full``). A publisher
whose version is not newer than what the store holds (a resumed run) first deletes the
abandoned timeline's versions from that one on.

Test: ``pytest tests/unit/sync/test_weights.py``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from opencomposer.sync import codec
from opencomposer.sync.layout import FORMAT, Entry, keys_of, scan

WINDOW = 512 << 20  # bytes of tensors encoded ahead of the blob's writer (host memory for their planes)


class WeightPublisher:
    def __init__(self, store, dtype: torch.dtype | str = torch.bfloat16, full_every: int = 20,
                 keep_full: int = 2, rank: int = 0, world: int = 1, timeline: str | None = None,
                 level: int = 3, keep_on: str = "device"):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} of world {world}: expected 0 <= rank < world")
        if world > 1 and timeline is None:
            raise ValueError("several ranks publish one version: pass the same timeline string on every rank")
        if keep_on not in ("device", "cpu"):
            raise ValueError(f"keep_on={keep_on!r}: expected 'device' (the previous version beside the weights) "
                             "or 'cpu' (in pinned host memory, copied over for each diff)")
        if full_every < 1 or keep_full < 1:
            raise ValueError(f"full_every={full_every}, keep_full={keep_full}: both must be >= 1")
        self.store, self.rank, self.world, self.level, self.keep_on = store, rank, world, level, keep_on
        self.dtype = codec.DTYPES[dtype] if isinstance(dtype, str) else dtype
        codec.dtype_name(self.dtype)
        self.full_every, self.keep_full = full_every, keep_full
        self.timeline = (timeline or uuid.uuid4().hex[:12]).lower()
        if not self.timeline.isalnum():
            raise ValueError(f"timeline {timeline!r}: letters and digits only")
        self.prev: dict[str, torch.Tensor] = {}  # name -> bits of the last published tensor
        self.sums: dict[str, list[int]] = {}  # name -> its checksum
        self.version: int | None = None  # last published
        self.last_full: int | None = None

    def tensors(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each storage once (a tied lm_head is the embedding); cast to the sync dtype one at a
        time as they are encoded."""
        out, seen = {}, set()
        for name, t in state_dict.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
            if key in seen:
                continue
            seen.add(key)
            out[name] = t.detach()
        if not out:
            raise ValueError("the state dict has no floating-point tensors to publish")
        return out

    def _start(self, version: int) -> None:
        """First publish: abandon any versions >= ``version`` another timeline wrote."""
        keys = self.store.list()
        done, partial = scan(keys)
        stale = [e for e in done + partial if e.version >= version and e.timeline != self.timeline]
        if stale:
            self.store.delete([k for e in stale for k in keys_of(e, keys)])

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, Any]:
        """Write ``version`` (> the last one published); return what it cost."""
        version = int(version)
        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version}: this publisher already published {self.version}; "
                             "versions must increase")
        t0 = time.perf_counter()
        tensors = self.tensors(state_dict)
        if self.version is None:
            self._start(version)
        full = self.last_full is None or version - self.last_full >= self.full_every or set(tensors) != set(self.prev)
        entry = Entry(version, self.timeline, "full" if full else "delta", self.world)
        metas: dict[str, dict] = {}
        sums: dict[str, torch.Tensor] = {}  # checksums still on the device: read together at the end
        totals = {"changed": 0, "numel": 0, "raw": 0, "stored": 0}

        def encoded():  # one tensor at a time: the diff on its device, compression in threads
            for name, src in tensors.items():
                t = src.to(self.dtype)
                old = None if full else self.prev[name].to(t.device, non_blocking=True)
                enc = codec.encode(t, old, self.level)
                if enc.info["encoding"] != "same":
                    sums[name] = codec.checksum_async(t)
                if full or name not in self.prev:
                    keep = codec.bits(t)
                    self.prev[name] = keep.to("cpu").pin_memory() if self.keep_on == "cpu" and keep.is_cuda \
                        else keep.clone()
                elif enc.info["changed"]:
                    self.prev[name].copy_(codec.bits(t))
                totals["changed"] += enc.info["changed"]
                totals["numel"] += t.numel()
                totals["raw"] += t.numel() * t.element_size()
                yield name, enc, t.numel() * t.element_size()

        def frames():  # the blob, streamed: at most WINDOW bytes of tensors wait for compression
            window, held = deque(), 0
            for item in encoded():
                window.append(item)
                held += item[2]
                while held > WINDOW or (window and window[0][1].done()):
                    held -= yield from emit(*window.popleft())
            while window:
                yield from emit(*window.popleft())

        def emit(name, enc, size):
            parts = enc.frames  # waits for this tensor's compression
            metas[name] = {**enc.meta, "offset": totals["stored"]}
            for part in parts:
                for f in part:
                    totals["stored"] += len(f)
                    yield f
            return size

        try:
            self.store.put(entry.blob(self.rank), frames())
        except BaseException:
            # ``prev`` may hold part of a version no follower will see: the next one is full
            self.last_full = None
            raise
        t1 = time.perf_counter()
        self.sums.update(zip(sums, map(list, codec.read_sums(list(sums.values())))))  # one host sync a device
        for name, meta in metas.items():
            meta["checksum"] = self.sums[name]
        manifest = {"format": FORMAT, "version": version, "timeline": self.timeline, "kind": entry.kind,
                    "rank": self.rank, "world": self.world, "dtype": codec.dtype_name(self.dtype),
                    "parent": None if full else self.version, "created": time.time(),
                    "blob_bytes": totals["stored"], "tensors": metas}
        try:
            self.store.put(entry.manifest(self.rank), json.dumps(manifest).encode())  # last: commits the part
        except BaseException:
            self.last_full = None
            raise
        t2 = time.perf_counter()
        self.version = version
        if full:
            self.last_full = version
        deleted = self._collect()
        return {"version": version, "kind": entry.kind, "timeline": self.timeline, "rank": self.rank,
                "tensors": len(tensors), "changed_fraction": totals["changed"] / max(totals["numel"], 1),
                "raw_bytes": totals["raw"], "stored_bytes": totals["stored"],
                "compression": totals["raw"] / max(totals["stored"], 1),
                "blob_s": t1 - t0, "commit_s": t2 - t1, "seconds": time.perf_counter() - t0,
                "deleted_objects": deleted}

    def _collect(self) -> int:
        """Delete this rank's objects of versions older than the ``keep_full``-th newest full
        snapshot (what a follower needs is that snapshot and the deltas after it)."""
        keys = self.store.list()
        done, partial = scan(keys)
        mine = [e for e in done if e.timeline == self.timeline]
        fulls = [e.version for e in mine if e.kind == "full"]
        if len(fulls) < self.keep_full:
            return 0
        oldest = sorted(fulls)[-self.keep_full]
        old = [e for e in done + partial if e.version < oldest]
        mine_keys = f"rank{self.rank:05d}-of-"
        drop = [k for e in old for k in keys_of(e, keys) if mine_keys in k or e.timeline != self.timeline]
        if drop:
            self.store.delete(drop)
        return len(drop)
