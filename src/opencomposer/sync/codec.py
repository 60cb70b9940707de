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

Payloads are zstd frames (with a content checksum, so a damaged blob is an error, not
wrong weights) of arrays whose bytes are shuffled into planes first (the high bytes of
small gaps and of XORs are zero: planes of zeros compress to almost nothing).

    enc = encode(new, old_bits)          # sender: old_bits = bits(previous tensor) or None
    patch = decode(enc.meta, enc.parts, device)     # receiver, outside any lock
    apply(patch, target)                 # receiver: in place, fast (a scatter or an xor)
    assert checksum(target) == tuple(enc.meta["checksum"])

Test: ``pytest tests/unit/sync/test_codec.py``.
"""

from __future__ import annotations

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


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """Two exact integer sums over the tensor's bytes (read as int16 or uint8): the plain
    sum and one weighted by position. Equal on every device and in any summation order, so
    the sender's and the receiver's tensors are compared without moving either."""
    flat = t.detach().contiguous().view(-1)
    w = flat.view(torch.int16) if (flat.numel() * flat.element_size()) % 2 == 0 else flat.view(torch.uint8)
    if flat.device not in _weights:
        _weights[flat.device] = torch.arange(_CHUNK, device=flat.device, dtype=torch.int64) % _PERIOD + 1
    pattern = _weights[flat.device]
    s1 = torch.zeros((), dtype=torch.int64, device=flat.device)
    s2 = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, w.numel(), _CHUNK):
        c = w[start:start + _CHUNK].to(torch.int64)
        s1 += c.sum()
        s2 += (c * pattern[:c.numel()]).sum()
    return int(s1), int(s2)


# --------------------------------------------------------------------------- bytes


def _pack(a: np.ndarray, level: int) -> bytes:
    planes = a.view(np.uint8).reshape(-1, a.itemsize).T.tobytes() if a.itemsize > 1 else a.tobytes()
    threads = -1 if len(planes) > 8 << 20 else 0  # large arrays (full snapshots): every core
    return zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True,
                                    threads=threads).compress(planes)


def _unpack(data: bytes, dtype: torch.dtype, n: int, what: str) -> torch.Tensor:
    np_dtype = np.dtype(_NP[dtype])
    try:
        raw = zstandard.ZstdDecompressor().decompress(data)
    except zstandard.ZstdError as e:
        raise CodecError(f"{what}: damaged payload ({e})") from None
    if len(raw) != n * np_dtype.itemsize:
        raise CodecError(f"{what}: payload holds {len(raw)} bytes, expected {n} x {np_dtype.itemsize}")
    a = np.frombuffer(raw, np.uint8)
    if np_dtype.itemsize > 1:
        a = np.ascontiguousarray(a.reshape(np_dtype.itemsize, n).T)
    return torch.from_numpy(a.view(np_dtype).reshape(-1).copy())


# --------------------------------------------------------------------------- encode


@dataclass
class Encoded:
    meta: dict[str, Any]  # encoding, shape, dtype, changed, checksum, and per part its length
    parts: list[bytes]


def encode(new: torch.Tensor, old: torch.Tensor | None, level: int = 3) -> Encoded:
    """``new`` against ``old`` (``bits`` of the previous version on the same device, or None
    for a full snapshot). The work that scales with the tensor (compare, gather) runs on
    ``new``'s device; only what changed is copied to the host."""
    new = new.detach().contiguous()
    nb = bits(new)
    meta: dict[str, Any] = {"shape": list(new.shape), "dtype": dtype_name(new.dtype), "numel": nb.numel(),
                            "checksum": list(checksum(new))}
    int_dtype = nb.dtype
    if old is None:
        parts = [_pack(nb.cpu().numpy(), level)]
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
            parts = [_pack(gaps.to(gap_dtype).cpu().numpy(), level), _pack(nb[idx].cpu().numpy(), level)]
            meta.update(encoding="sparse", gap_dtype=dtype_name(gap_dtype))
        else:
            parts = [_pack((nb ^ old).cpu().numpy(), level)]
            meta["encoding"] = "xor"
    meta["int_dtype"] = dtype_name(int_dtype)
    meta["parts"] = [len(p) for p in parts]
    return Encoded(meta, parts)


# --------------------------------------------------------------------------- decode / apply


@dataclass
class Patch:
    """A decoded tensor update, ready to apply (its arrays on the target's device)."""

    name: str
    encoding: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    arrays: list[torch.Tensor]
    checksum: tuple[int, int]


def decode(name: str, meta: dict[str, Any], parts: list[bytes], device: torch.device | str = "cpu") -> Patch:
    """Decompress one tensor's parts (host work) and move them to ``device``."""
    try:
        enc, n, shape = meta["encoding"], int(meta["numel"]), tuple(meta["shape"])
        dtype, int_dtype = DTYPES[meta["dtype"]], DTYPES[meta["int_dtype"]]
    except KeyError as e:
        raise CodecError(f"{name}: manifest entry lacks or misnames {e}") from None
    expect = {"same": 0, "raw": 1, "xor": 1, "sparse": 2}.get(enc)
    if expect is None:
        raise CodecError(f"{name}: unknown encoding {enc!r}; known: same, raw, xor, sparse")
    if len(parts) != expect:
        raise CodecError(f"{name}: encoding {enc} has {expect} parts, got {len(parts)}")
    if enc == "sparse":
        k = int(meta["changed"])
        gaps = _unpack(parts[0], DTYPES[meta["gap_dtype"]], k, f"{name} (positions)").to(torch.int64)
        if k and (int(gaps.min()) < 1 or int(gaps.sum()) > n):
            raise CodecError(f"{name}: changed positions are not increasing inside the tensor's {n} elements")
        arrays = [torch.cumsum(gaps, 0) - 1, _unpack(parts[1], int_dtype, k, f"{name} (values)")]
    else:
        arrays = [_unpack(p, int_dtype, n, name) for p in parts]
    if device != "cpu" and torch.device(device).type != "cpu":
        arrays = [a.pin_memory().to(device, non_blocking=True) for a in arrays]
    return Patch(name, enc, shape, dtype, arrays, tuple(meta["checksum"]))


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
    arrays = [a.to(tb.device) for a in patch.arrays]
    if patch.encoding == "raw":
        tb.copy_(arrays[0])
    elif patch.encoding == "xor":
        tb.bitwise_xor_(arrays[0])
    else:  # positions checked by decode
        tb[arrays[0]] = arrays[1]
