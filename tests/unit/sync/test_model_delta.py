"""sync/model_delta.py: a safetensors file as its exact differences from a reference, rebuilt bit for
bit; a tensor the reference lacks or has in another shape travels whole; a wrong reference, a
truncated copy or a file of another kind is refused naming the file."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from opencomposer.sync.model_delta import DeltaError, apply_delta, write_delta


def _reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(512, 64, generator=g), "layer.0.q.weight": torch.randn(64, 64, generator=g),
            "layer.0.norm.weight": torch.ones(64), "head.weight": torch.randn(32, 64, generator=g)}


def _tuned(ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What fine-tuning makes of ``ref``, in bf16: small moves everywhere, a norm left alone, a head of
    another shape and a tensor the reference lacks."""
    g = torch.Generator().manual_seed(1)
    out = {k: (v + 1e-3 * torch.randn(v.shape, generator=g)).to(torch.bfloat16) for k, v in ref.items()}
    out["layer.0.norm.weight"] = ref["layer.0.norm.weight"].to(torch.bfloat16)
    out["head.weight"] = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    out["mtp.0.weight"] = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    out["step"] = torch.tensor([7], dtype=torch.int64)
    return out


def test_a_tuned_model_crosses_as_its_delta_and_comes_back_bit_for_bit(tmp_path):
    ref = _reference()
    model = tmp_path / "model.safetensors"
    save_file(_tuned(ref), model, metadata={"format": "pt"})
    res = write_delta(model, ref, tmp_path / "model.safetensors.delta", against="tiny")
    assert res["tensors"] == 6 and res["from_reference"] == 3  # embed, q, norm; head, mtp and step whole
    plain = len(__import__("zstandard").ZstdCompressor(level=10).compress(model.read_bytes()))
    assert res["bytes_out"] < 0.8 * plain  # the XOR planes compress better than the file does
    back = tmp_path / "back.safetensors"
    assert apply_delta(tmp_path / "model.safetensors.delta", ref, back)["tensors"] == 6
    assert hashlib.sha256(back.read_bytes()).digest() == hashlib.sha256(model.read_bytes()).digest()
    a, b = load_file(model), load_file(back)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_a_wrong_reference_a_damaged_copy_or_another_file_is_refused(tmp_path):
    ref = _reference()
    model = tmp_path / "model.safetensors"
    save_file(_tuned(ref), model)
    delta = tmp_path / "model.safetensors.delta"
    write_delta(model, ref, delta, against="tiny")
    other = dict(ref, **{"layer.0.q.weight": ref["layer.0.q.weight"] + 1e-2})
    with pytest.raises(DeltaError, match=r"model.safetensors.delta: made against 'tiny' \(fingerprint \w+\), the "
                                         r"reference given is another"):
        apply_delta(delta, other, tmp_path / "back.safetensors")
    cut = tmp_path / "cut.delta"
    cut.write_bytes(delta.read_bytes()[:-100])
    with pytest.raises(DeltaError, match=r"cut.delta: \S+: its frames run past the file's end"):
        apply_delta(cut, ref, tmp_path / "back.safetensors")
    with pytest.raises(DeltaError, match=r"model.safetensors: not a model delta"):
        apply_delta(model, ref, tmp_path / "back.safetensors")
    flipped = bytearray(delta.read_bytes())
    flipped[-5] ^= 0xFF  # inside the last tensor's frames: zstd's checksum or the tensor's sha256 says so
    (tmp_path / "flip.delta").write_bytes(bytes(flipped))
    with pytest.raises(DeltaError, match=r"flip.delta: \S+: "):
        apply_delta(tmp_path / "flip.delta", ref, tmp_path / "back.safetensors")
    assert not (tmp_path / "back.safetensors").exists()  # nothing half-made is left to be read
