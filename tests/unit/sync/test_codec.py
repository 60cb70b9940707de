"""One tensor's version against the previous one: every encoding lossless, bit for bit."""

from __future__ import annotations

import pytest
import torch

from opencomposer.sync import codec


def _step(w: torch.Tensor, lr: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return w + lr * torch.randn(w.shape, generator=g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lr,expect", [(0.0, "same"), (1e-7, "sparse"), (1e-2, "xor"), (None, "raw")])
def test_each_encoding_reproduces_the_new_tensor_bit_for_bit(dtype, lr, expect):
    master = torch.randn(300, 257, generator=torch.Generator().manual_seed(1)) * 0.02
    old = master.to(dtype)
    new = (master if not lr else _step(master, lr)).to(dtype)
    if dtype == torch.float32 and expect == "sparse":
        new = old.clone()
        new.view(-1)[::97] += 1e-3  # fp32 moves every element under a real step: make it sparse
    enc = codec.encode(new, None if lr is None else codec.bits(old))
    assert enc.meta["encoding"] == expect
    target = old.clone()
    patch = codec.decode("w", {**enc.meta, "checksum": [0, 0]}, enc.parts)
    codec.check([patch])
    codec.apply(patch, target)
    assert torch.equal(codec.bits(target), codec.bits(new))
    assert codec.checksum(target) == codec.checksum(new)
    if expect == "sparse":  # what changed is what is sent: far less than the tensor
        assert sum(map(sum, enc.meta["parts"])) < 0.25 * new.numel() * new.element_size()


def test_a_non_contiguous_target_is_written_through_a_copy():
    base = torch.randn(8, 6).to(torch.bfloat16)
    new = base.clone()
    new[2, 3] += 1
    enc = codec.encode(new.t(), codec.bits(base.t()))
    target = base.clone()
    codec.apply(codec.decode("w", {**enc.meta, "checksum": [0, 0]}, enc.parts), target.t())
    assert torch.equal(target, new)


def test_the_checksum_sees_a_swap_of_two_elements():
    a = torch.arange(10, dtype=torch.float32)
    b = a.clone()
    b[[2, 7]] = b[[7, 2]]
    assert codec.checksum(a)[0] == codec.checksum(b)[0] and codec.checksum(a) != codec.checksum(b)


def test_damaged_or_mismatched_payloads_are_errors_naming_the_tensor():
    old = torch.randn(64, 64).to(torch.bfloat16)
    new = old.clone()
    new[0, :5] += 1
    enc = codec.encode(new, codec.bits(old))
    meta = {**enc.meta, "checksum": [0, 0]}
    bad = [enc.parts[0], enc.parts[1][:-3] + b"xyz"]
    with pytest.raises(codec.CodecError, match=r"layers\.0\.w \(values\): damaged"):
        codec.decode("layers.0.w", meta, bad)
    with pytest.raises(codec.CodecError, match="unknown encoding 'zip'"):
        codec.decode("w", {**meta, "encoding": "zip"}, enc.parts)
    with pytest.raises(codec.CodecError, match="w: changed positions are not increasing inside the tensor"):
        codec.check([codec.decode("w", {**meta, "numel": 3}, enc.parts)])
    with pytest.raises(codec.CodecError, match=r"w \(values\): payload holds"):
        codec.decode("w", meta, [enc.parts[0], enc.parts[1] + b"\0"])
    patch = codec.decode("w", meta, enc.parts)
    with pytest.raises(codec.CodecError, match=r"w: update is \(64, 64\) torch.bfloat16, the tensor is \(64, 64\) "
                                               r"torch.float32"):
        codec.apply(patch, torch.zeros(64, 64))
    with pytest.raises(codec.CodecError, match="shape and dtype cannot change"):
        codec.encode(new, codec.bits(old.float()))


def test_a_tensor_larger_than_a_frame_round_trips_in_several_frames():
    new = torch.randn(3 * codec.FRAME // 4 + 123).to(torch.float32)  # 3 MiB and a bit, raw
    enc = codec.encode(new, None)
    assert len(enc.meta["parts"][0]) == 4  # 3 MiB + 492 bytes
    target = torch.zeros_like(new)
    codec.apply(codec.decode("big", {**enc.meta, "checksum": [0, 0]}, enc.parts), target)
    assert torch.equal(target, new)
