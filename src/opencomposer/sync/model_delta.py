"""A safetensors file as its exact differences from a reference model both ends can make.

A fine-tuned model moves every weight a little: in bfloat16 the sign, the exponent and the
top of the mantissa mostly stay, so the XOR of the two bit patterns is mostly zero bits, and
byte planes of it compress to well under half the file (the embedded SmolLM2-135M after SFT:
269 MB -> 101 MB). Where a link is narrow (a device call carries 64 MiB; an air-gapped
cluster's transfer) and the reference is at both ends (the embedded GGUF, a hub model), the
delta is what crosses.

    ref = load_model("smollm2-135m")[0].state_dict()
    write_delta(Path("sft/model.safetensors"), ref, Path("sft/model.safetensors.delta"), against="smollm2-135m")
    apply_delta(Path("sft/model.safetensors.delta"), ref, Path("sft/model.safetensors"))

Each tensor goes through ``codec.encode`` against the reference's tensor cast to its dtype
(the same tensor-level code as weight sync; a tensor the reference lacks, or has in another
shape, is stored whole). The file: ``MAGIC``, the header's length (8 bytes, little-endian),
the header (JSON: what it was made against, the reference's fingerprint, per tensor the
codec's meta, its frames' place and its bytes' sha256), then the frames. ``apply_delta``
refuses a reference whose fingerprint differs, naming both, and checks every rebuilt tensor's
sha256 before it writes the file (beside its name, then renamed: no half-made model is read).

Test: ``pytest tests/unit/sync/test_model_delta.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from opencomposer.paths import temp_name
from opencomposer.sync import codec

MAGIC = b"OCDELTA1\n"
FORMAT_VERSION = 1


class DeltaError(ValueError):
    """A delta that does not fit its reference, or a damaged delta file (names the file)."""


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(codec.bits(t).numpy().tobytes()).hexdigest()


def _cast(reference: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """The reference as the delta sees it: each tensor named in ``dtypes`` that it has, cast to that dtype on
    the CPU (made once per delta: both the fingerprint and the XOR read it)."""
    return {n: reference[n].detach().to("cpu", dtypes[n]).contiguous() for n in sorted(dtypes) if n in reference}


def fingerprint(cast: Mapping[str, torch.Tensor]) -> str:
    """A hash of the cast reference (``_cast``): names, shapes and bits."""
    h = hashlib.sha256()
    for name, t in cast.items():
        h.update(name.encode() + b"\0" + str(tuple(t.shape)).encode() + b"\0")
        h.update(codec.bits(t).numpy().tobytes())
    return h.hexdigest()


def write_delta(model_file: Path, reference: Mapping[str, torch.Tensor], out: Path, against: str = "",
                level: int = 10) -> dict:
    """``model_file`` (safetensors) as a delta against ``reference`` (name -> tensor), written to ``out``."""
    from safetensors import safe_open

    with safe_open(str(model_file), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for k, t in tensors.items():
        codec.dtype_name(t.dtype)  # refuses a dtype the codec cannot carry, naming it
    cast = _cast(reference, {k: t.dtype for k, t in tensors.items()})
    old = {k: codec.bits(cast[k]) for k, t in tensors.items() if k in cast and cast[k].shape == t.shape}
    encoded = {k: codec.encode(t, old.get(k), level) for k, t in tensors.items()}  # no reference: stored whole
    entries, blobs, at = [], [], 0
    for k, enc in encoded.items():
        meta = dict(enc.meta)
        meta["checksum"] = list(codec.checksum(tensors[k]))
        parts = enc.parts
        entries.append({"name": k, "meta": meta, "offset": at, "sizes": [len(p) for p in parts],
                        "sha256": _sha(tensors[k])})
        blobs.extend(parts)
        at += sum(len(p) for p in parts)
    header = {"format_version": FORMAT_VERSION, "against": against, "metadata": metadata,
              "reference_sha256": fingerprint(cast),
              "from_reference": sum(e["meta"]["encoding"] != "raw" for e in entries), "tensors": entries}
    body = json.dumps(header).encode()
    tmp = temp_name(out)
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(body)) + body)
            for b in blobs:
                f.write(b)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return {"file": str(out), "tensors": len(entries), "from_reference": header["from_reference"],
            "bytes_in": model_file.stat().st_size, "bytes_out": out.stat().st_size}


def read_header(delta: Path) -> tuple[dict, int]:
    """The header of ``delta`` and where its frames begin."""
    with open(delta, "rb") as f:
        head = f.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or not head.startswith(MAGIC):
            raise DeltaError(f"{delta}: not a model delta (expected it to begin with {MAGIC!r})")
        (n,) = struct.unpack("<Q", head[len(MAGIC):])
        body = f.read(n)
    try:
        header = json.loads(body)
    except ValueError as e:
        raise DeltaError(f"{delta}: damaged header ({e})") from None
    if header.get("format_version") != FORMAT_VERSION:
        raise DeltaError(f"{delta}: format_version {header.get('format_version')!r}, this code reads {FORMAT_VERSION}")
    return header, len(MAGIC) + 8 + n


def apply_delta(delta: Path, reference: Mapping[str, torch.Tensor], out: Path) -> dict:
    """The safetensors file ``delta`` was made from, rebuilt from ``reference`` at ``out``, exactly."""
    from safetensors.torch import save_file

    header, start = read_header(delta)
    dtypes = {e["name"]: codec.DTYPES[e["meta"]["dtype"]] for e in header["tensors"]}
    cast = _cast(reference, dtypes)
    have = fingerprint(cast)
    if have != header["reference_sha256"]:
        raise DeltaError(f"{delta}: made against {header['against'] or 'another model'!r} (fingerprint "
                         f"{header['reference_sha256'][:16]}), the reference given is another (fingerprint {have[:16]})")
    data = memoryview(delta.read_bytes())[start:]
    out_tensors = {}
    for e in header["tensors"]:
        name, meta = e["name"], e["meta"]
        parts, at = [], e["offset"]
        for size in e["sizes"]:
            if at + size > len(data):
                raise DeltaError(f"{delta}: {name}: its frames run past the file's end (a truncated copy?)")
            parts.append(data[at:at + size])
            at += size
        dtype = dtypes[name]
        if meta["encoding"] == "raw":
            target = torch.empty(meta["shape"], dtype=dtype)
        else:
            target = cast[name].clone()
        try:
            patch = codec.decode(name, meta, parts)
            codec.check([patch])
            codec.apply(patch, target)
        except Exception as err:  # a damaged frame (zstd), a bad meta: say which file and tensor
            raise DeltaError(f"{delta}: {name}: {err}") from None
        if _sha(target) != e["sha256"]:
            raise DeltaError(f"{delta}: {name}: the rebuilt tensor's sha256 differs from the one recorded")
        out_tensors[name] = target
    tmp = temp_name(out)
    try:
        save_file(out_tensors, tmp, metadata=header["metadata"] or None)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return {"file": str(out), "tensors": len(out_tensors), "against": header["against"]}
