"""One tensor's new version, encoded exactly and compactly against its previous version.

A trainer step moves few of a bf16 model's values: with fp32 master weights, an update
of ~1e-6 changes a bf16 value only when it crosses half a ULP (~4e-5 for a weight of
0.01), so most elements keep their bit pattern. Sending only what changed is what
makes weight sync fast (Cursor's "each training rank transmits only the differences").
Every encoding is lossless: the receiver's tensor ends bit-identical to the sender's.

* ``same``    nothing changed: nothing stored
* ``sparse``  the positions that changed (as gaps between them) and their new bit patterns
* ``xor``     new XOR old over the whole tensor (most elements changed, e.g. fp32 weights)
* ``raw``     the tensor itself (a full snapshot)

Payloads are zstd frames of 1 MiB each (compressed and decompressed on every core; each
with a content checksum, so a damaged blob is an error, not wrong weights) of arrays
whose bytes are split into planes first, on the tensor's own device (the high bytes of
small gaps and of XORs are zero: planes of zeros compress to almost nothing).

    enc = encode(new, old_bits)          # sender: old_bits = bits(previous tensor) or None
    patch = decode(name, enc.meta, enc.parts, device)   # receiver, outside any lock
    check([patch])                       # positions inside the tensor (one sync for many)
    apply(patch, target)                 # receiver: in place, fast (a scatter or an xor)
    assert checksum(target) == checksum(new)

Test: ``pytest tests/unit/sync/test_codec.py``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP = {torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}
DTYPES = {str(d).removeprefix("torch."): d for d in
          (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.uint8)}
_PERIOD = 251  # checksum weights cycle with this period
_CHUNK = _PERIOD * 65536


class CodecError(ValueError):
    """A payload that cannot be decoded into the tensor it claims to be."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (a view when contiguous), flat."""
    return t.contiguous().view(-1).view(_INT[t.element_size()])


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise CodecError(f"dtype {name} is not supported; supported: {sorted(DTYPES)}")
    return name


_weights: dict[torch.device, torch.Tensor] = {}


def checksum_async(t: torch.Tensor) -> torch.Tensor:
    """``checksum`` left on the tensor's device (two int64s): read many with ``read_sums``."""
    flat = t.detach().contiguous().view(-1)
    w = flat.view(torch.int16) if (flat.numel() * flat.element_size()) % 2 == 0 else flat.view(torch.uint8)
    if flat.device not in _weights:
        _weights[flat.device] = torch.arange(_CHUNK, device=flat.device, dtype=torch.int32) % _PERIOD + 1
    pattern = _weights[flat.device]
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, w.numel(), _CHUNK):
        c = w[start:start + _CHUNK]
        out[0] += c.sum(dtype=torch.int64)
        out[1] += (c.to(torch.int32) * pattern[:c.numel()]).sum(dtype=torch.int64)  # |x| < 2**15 * 251
    return out


def checksums(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """For each tensor, two exact integer sums over its bytes (read as int16 or uint8): the
    plain sum and one weighted by position. Equal on every device and in any summation
    order, so sender and receiver compare tensors without moving them."""
    return read_sums([checksum_async(t) for t in tensors])


def read_sums(sums: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Device checksums (``checksum_async``) to the host: one copy per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, pair in enumerate(sums):
        by_device.setdefault(pair.device, []).append(i)
    out: list[tuple[int, int]] = [(0, 0)] * len(sums)
    for idx in by_device.values():
        for i, pair in zip(idx, torch.stack([sums[i] for i in idx]).tolist()):
            out[i] = tuple(pair)
    return out


def checksum(t: torch.Tensor) -> tuple[int, int]:
    return checksums([t])[0]


# --------------------------------------------------------------------------- bytes

FRAME = 1 << 20  # bytes of input per zstd frame: frames compress and decompress in parallel
_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:  # zstd releases the GIL: frames run on every core
        _pool = ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1), thread_name_prefix="zstd")
    return _pool


def _planes(a: torch.Tensor) -> torch.Tensor:
    """The array's bytes, plane by plane (all first bytes, then all second bytes, ...), on
    its own device: the high bytes of small integers and XORs are runs of zeros."""
    k = a.element_size()
    b = a.contiguous().view(torch.uint8)
    return b if k == 1 else b.view(-1, k).t().contiguous().view(-1)


class _Packing:
    """An array's byte planes copied to the host and handed, frame by frame, to the zstd threads."""

    def __init__(self, a: torch.Tensor, level: int):
        planes = memoryview(_planes(a).cpu().numpy())
        compress = lambda c: zstandard.ZstdCompressor(level=level, write_checksum=True).compress(c)
        chunks = [planes[i:i + FRAME] for i in range(0, len(planes), FRAME)] or [planes]
        self.futures = [_threads().submit(compress, c) for c in chunks]

    def frames(self) -> list[bytes]:
        return [f.result() for f in self.futures]


class _Unpacking:
    """One part's frames handed to the zstd threads, decompressing into ``out`` (host bytes)."""

    def __init__(self, data, frames: list[int], out: np.ndarray, k: int, what: str):
        self.out, self.k, self.what = out, k, what
        if sum(frames) != len(data):
            raise CodecError(f"{what}: payload holds {len(data)} bytes, its frames {sum(frames)}")
        bounds = np.cumsum([0, *frames]).tolist()
        view, size = memoryview(data), len(out)

        def one(i: int) -> int:
            at = min(i * FRAME, size)
            got = zstandard.ZstdDecompressor().decompress(view[bounds[i]:bounds[i + 1]],
                                                          max_output_size=min(FRAME, size - at) or 1)
            out[at:at + len(got)] = np.frombuffer(got, np.uint8)
            return len(got)
        self.futures = [_threads().submit(one, i) for i in range(len(frames))]

    def wait(self) -> None:
        try:
            got = sum(f.result() for f in self.futures)
        except (zstandard.ZstdError, ValueError) as e:
            raise CodecError(f"{self.what}: damaged payload ({e})") from None
        if got != len(self.out):
            raise CodecError(f"{self.what}: payload holds {got} bytes, expected {len(self.out) // self.k} x {self.k}")


class Staging:
    """One pinned host buffer, reused by one reader (not thread-safe: one per subscriber):
    every part of a version lands in it and crosses to the device in one copy (a pinned
    allocation per part synchronised the device each time)."""

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None

    def take(self, size: int) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()  # the last copy out of it has finished
        if self.buf is None or self.buf.numel() < size:
            self.buf = torch.empty(max(size, 1 << 20), dtype=torch.uint8, pin_memory=True)
        return self.buf[:size]

    def to(self, host: torch.Tensor, device) -> torch.Tensor:
        out = host.to(device, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()
        return out


@dataclass
class _Planes:
    """An array still split into byte planes, in host memory: a full snapshot's tensors
    cross to the device one at a time, inside the apply, where the planes are undone."""

    planes: torch.Tensor
    dtype: torch.dtype


def _unplane(planes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    k = torch.empty((), dtype=dtype).element_size()
    return (planes if k == 1 else planes.view(k, -1).t().contiguous()).view(-1).view(dtype)


def _tensor(a: Any, device: torch.device | None = None) -> torch.Tensor:
    """A decoded array as a tensor (on ``device`` if given), its byte planes undone there."""
    if isinstance(a, _Planes):
        return _unplane(a.planes if device is None else a.planes.to(device), a.dtype)
    return a if device is None else a.to(device)


# --------------------------------------------------------------------------- encode


class Encoded:
    """One tensor's update. Compression runs in threads: encode every tensor first, then read
    ``frames`` / ``meta`` (which wait for it). ``info`` is known at once: encoding, shape,
    dtype, changed; ``meta`` adds per part its frames' lengths."""

    def __init__(self, info: dict[str, Any], packing: list[_Packing]):
        self.info, self._packing, self._frames = info, packing, None

    @property
    def frames(self) -> list[list[bytes]]:
        if self._frames is None:
            self._frames = [p.frames() for p in self._packing]
            self.info["parts"] = [[len(f) for f in part] for part in self._frames]
            self._packing = []
        return self._frames

    def done(self) -> bool:
        """Its compression has finished (reading ``frames`` will not wait)."""
        return self._frames is not None or all(f.done() for p in self._packing for f in p.futures)

    @property
    def meta(self) -> dict[str, Any]:
        _ = self.frames
        return self.info

    @property
    def parts(self) -> list[bytes]:
        return [b"".join(part) for part in self.frames]


def encode(new: torch.Tensor, old: torch.Tensor | None, level: int = 3) -> Encoded:
    """``new`` against ``old`` (``bits`` of the previous version on the same device, or None
    for a full snapshot). The work that scales with the tensor (compare, gather) runs on
    ``new``'s device; only what changed is copied to the host."""
    new = new.detach().contiguous()
    nb = bits(new)
    meta: dict[str, Any] = {"shape": list(new.shape), "dtype": dtype_name(new.dtype), "numel": nb.numel()}
    int_dtype = nb.dtype
    if old is None:
        parts = [_Packing(nb, level)]
        meta.update(encoding="raw", changed=nb.numel())
    else:
        if old.shape != nb.shape or old.dtype != nb.dtype:
            raise CodecError(f"previous version is {tuple(old.shape)} {old.dtype}, new is {tuple(nb.shape)} "
                             f"{nb.dtype} (as integers): a tensor's shape and dtype cannot change")
        changed = nb != old
        idx = changed.nonzero().squeeze(1)
        n = idx.numel()
        meta["changed"] = n
        if n == 0:
            parts, meta["encoding"] = [], "same"
        elif n * (4 + nb.element_size()) * 2 <= nb.numel() * nb.element_size():
            gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))
            gap_dtype = torch.int32 if nb.numel() < 2**31 else torch.int64
            parts = [_Packing(gaps.to(gap_dtype), level), _Packing(nb[idx], level)]
            meta.update(encoding="sparse", gap_dtype=dtype_name(gap_dtype))
        else:
            parts = [_Packing(nb ^ old, level)]
            meta["encoding"] = "xor"
    meta["int_dtype"] = dtype_name(int_dtype)
    return Encoded(meta, parts)


# --------------------------------------------------------------------------- decode / apply


@dataclass
class Patch:
    """A decoded tensor update, ready to apply (its arrays on the target's device)."""

    name: str
    encoding: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    arrays: list[Any]  # tensors on the device, or (decoded for the host) byte planes
    checksum: tuple[int, int]
    valid: torch.Tensor | None = None  # sparse: positions increasing and inside (checked by ``check``)


def decode(name: str, meta: dict[str, Any], parts: list, device: torch.device | str = "cpu") -> Patch:
    return decode_all([(name, meta, parts)], device)[0]


def decode_all(items: list[tuple[str, dict[str, Any], list]], device: torch.device | str = "cpu",
               staging: Staging | None = None) -> list[Patch]:
    """Decompress tensors' parts (every frame of every tensor in the zstd threads at once),
    move them to ``device`` (one copy) and undo the byte planes there. Sparse positions are
    checked on the device: call ``check``."""
    plans, total = [], 0
    for name, meta, parts in items:
        try:
            enc, n, frames = meta["encoding"], int(meta["numel"]), meta["parts"]
            int_dtype = DTYPES[meta["int_dtype"]]
            dtypes = [DTYPES[meta["gap_dtype"]], int_dtype] if enc == "sparse" else [int_dtype]
        except KeyError as e:
            raise CodecError(f"{name}: manifest entry lacks or misnames {e}") from None
        expect = {"same": 0, "raw": 1, "xor": 1, "sparse": 2}.get(enc)
        if expect is None:
            raise CodecError(f"{name}: unknown encoding {enc!r}; known: same, raw, xor, sparse")
        if len(parts) != expect or len(frames) != expect:
            raise CodecError(f"{name}: encoding {enc} has {expect} parts, got {len(parts)}")
        count = int(meta["changed"]) if enc == "sparse" else n
        what = [f"{name} (positions)", f"{name} (values)"] if enc == "sparse" else [name]
        layout = []
        for dtype, w in zip(dtypes[:expect], what):
            k = torch.empty((), dtype=dtype).element_size()
            layout.append((total, count * k, k, dtype, w))
            total += count * k
        plans.append((name, meta, parts, layout))
    cuda = torch.device(device).type == "cuda"
    staging = staging or (Staging() if cuda else None)
    host = staging.take(total).numpy() if cuda else np.empty(total, np.uint8)
    work = [[_Unpacking(data, frames, host[at:at + size], k, w)
             for data, frames, (at, size, k, _, w) in zip(parts, meta["parts"], layout)]
            for _, meta, parts, layout in plans]
    for parts in work:
        for w in parts:
            w.wait()
    if cuda:
        moved = staging.to(torch.from_numpy(host), device)
        arrays = lambda layout: [_unplane(moved[at:at + size], dtype) for at, size, _, dtype, _ in layout]
    else:  # on the host the planes stay: a full snapshot's are undone on the target's device
        arrays = lambda layout: [_Planes(torch.from_numpy(host[at:at + size]), dtype)
                                 for at, size, _, dtype, _ in layout]
    return [_patch(name, meta, arrays(layout)) for name, meta, _, layout in plans]


def _patch(name: str, meta: dict[str, Any], arrays: list) -> Patch:
    try:
        shape, dtype, sums = tuple(meta["shape"]), DTYPES[meta["dtype"]], tuple(meta["checksum"])
    except KeyError as e:
        raise CodecError(f"{name}: manifest entry lacks or misnames {e}") from None
    valid = None
    if meta["encoding"] == "sparse":
        gaps, values = (_tensor(a) for a in arrays)  # small: planes undone here, wherever they are
        idx = torch.cumsum(gaps.to(torch.int64), 0) - 1
        valid = (gaps.min() >= 1) & (idx[-1] < int(meta["numel"])) if idx.numel() else None
        arrays = [idx, values]
    return Patch(name, meta["encoding"], shape, dtype, arrays, sums, valid)


def check(patches: list[Patch]) -> None:
    """Refuse patches whose positions would write outside their tensor (one host sync)."""
    flagged = [p for p in patches if p.valid is not None]
    if not flagged:
        return
    ok = torch.stack([p.valid.to(flagged[0].valid.device) for p in flagged]).tolist()
    bad = [p.name for p, good in zip(flagged, ok) if not good]
    if bad:
        raise CodecError(f"{bad[0]}: changed positions are not increasing inside the tensor "
                         f"({len(bad)} tensors like this)")


def apply(patch: Patch, target: torch.Tensor) -> None:
    """Write ``patch`` into ``target`` in place (the caller holds whatever lock the target needs)."""
    if tuple(target.shape) != patch.shape or target.dtype != patch.dtype:
        raise CodecError(f"{patch.name}: update is {patch.shape} {patch.dtype}, the tensor is "
                         f"{tuple(target.shape)} {target.dtype}")
    if patch.encoding == "same":
        return
    if not target.is_contiguous():  # a view we cannot reinterpret in place: edit a copy
        tmp = target.contiguous()
        apply(patch, tmp)
        target.copy_(tmp)
        return
    tb = bits(target)
    arrays = [_tensor(a, tb.device) for a in patch.arrays]
    if patch.encoding == "raw":
        tb.copy_(arrays[0])
    elif patch.encoding == "xor":
        tb.bitwise_xor_(arrays[0])
    else:  # positions checked by ``check``
        tb[arrays[0]] = arrays[1]
