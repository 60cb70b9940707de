"""benchmarks/carry_parts.py: a model directory shipped in parts over several calls, gathered into
carry folders, restored on the far side as bf16 weights the loader reads back; a missing or
damaged part is refused naming it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from opencomposer.models import load_model
from testkit.scripts import load_benchmark

cp = load_benchmark("carry_parts")


@pytest.fixture
def model_dir(tmp_path) -> Path:
    model, tok = load_model("tiny-random")
    d = tmp_path / "run" / "arm" / "sft_model"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_a_model_goes_over_in_parts_and_comes_back_in_bf16(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(cp, "PART_BYTES", 1_500_000)  # tiny-random in bf16 is ~8 MB: 6 parts, two calls
    run, work = tmp_path / "run", tmp_path / "work"
    shutil.copytree(model_dir, tmp_path / "fp32")
    returned, left, group = [], 1, 0
    while left:  # one device call each
        out = tmp_path / f"out{group}"
        res = cp.ship(model_dir, work, out, group, run, bf16=True, in_place=True)
        assert len(res["files"]) <= cp.PER_CALL + 1 and res["ship"] == "arm/sft_model"
        returned += sorted(out.iterdir())
        left, group = res["left"], group + 1
    assert group >= 2
    with pytest.raises(cp.PartsError, match="more than a call can carry beside the tree"):
        cp.gather(returned, str(tmp_path / "carry" / ".gpuz-sft"), max_bytes=1_000_000)  # a part is 1.5 MB
    # the command: folders sized by --max-mib, or by what a device session's call carries beside the tree (carry_room.sh --slim)
    assert cp.main(["gather", *map(str, returned), "--into", str(tmp_path / "cli" / ".gpuz-a"), "--max-mib", "1"]) == 2
    assert cp.main(["gather", *map(str, returned), "--into", str(tmp_path / "cli" / ".gpuz-b")]) == 0
    room = cp.carry_room_bytes()
    assert room >= 4 << 20 and all(sum(f.stat().st_size for f in d.iterdir()) <= room
                                   for d in (tmp_path / "cli").glob(".gpuz-b*"))
    g = cp.gather(returned, str(tmp_path / "carry" / ".gpuz-sft"), max_bytes=4_000_000)
    assert len(g["dirs"]) >= 2
    assert all(sum(f.stat().st_size for f in Path(d).iterdir()) <= 4_000_000 for d in g["dirs"])
    incoming = tmp_path / "incoming"  # the next machine: every carried folder copied into one place
    incoming.mkdir()
    for d in g["dirs"]:
        for f in Path(d).iterdir():
            (incoming / f.name).write_bytes(f.read_bytes())
    far = tmp_path / "far"
    assert cp.restore(incoming, far) == {"restored": ["arm/sft_model"], "already_there": []}
    assert cp.restore(incoming, far)["already_there"] == ["arm/sft_model"]

    original, _ = load_model(str(tmp_path / "fp32"))
    back, _ = load_model(str(far / "arm" / "sft_model"))
    here, _ = load_model(str(model_dir))  # --in-place: the shipping machine goes on from the same weights
    assert all(torch.equal(here.state_dict()[k], v) for k, v in back.state_dict().items())
    a, b = original.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert b[k].dtype == torch.float32  # loaded for training as float32
        assert torch.equal(b[k], a[k].to(torch.bfloat16).float()), k


def test_a_missing_or_damaged_part_is_refused(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(cp, "PART_BYTES", 8_000_000)
    out = tmp_path / "out"
    res = cp.ship(model_dir, tmp_path / "work", out, 0, tmp_path / "run")
    manifest = json.loads((out / f"arm__sft_model.{cp.MANIFEST}").read_text())
    assert len(manifest["parts"]) > 1 and not manifest["bf16"]
    first = out / res["files"][0]
    data = bytearray(first.read_bytes())
    first.unlink()
    with pytest.raises(cp.PartsError, match=r"1 of \d+ parts not carried yet \(arm__sft_model.payload.tar.part-000"):
        cp.restore(out, tmp_path / "far")
    data[-1] ^= 0xFF  # one byte of the payload flipped
    first.write_bytes(bytes(data))
    with pytest.raises(cp.PartsError, match=r"payload.tar.part-000: damaged: .* sha256"):
        cp.restore(out, tmp_path / "far")
    assert not (tmp_path / "far" / "arm" / "sft_model").exists()  # nothing half-made is left to be read
    with pytest.raises(cp.PartsError, match=r"--group 9: .* groups 0..0"):
        cp.ship(model_dir, tmp_path / "work", out, 9, tmp_path / "run")


def test_a_directory_that_changed_is_shipped_again_and_its_states_never_mix(tmp_path, monkeypatch):
    # session 41: an RL run shipped at step 23, resumed for a step, then shipped again returned step 23's parts
    monkeypatch.setattr(cp, "PART_BYTES", 300_000)
    run, work = tmp_path / "run", tmp_path / "work"
    ck = run / "arm" / "rl_run" / "checkpoints"
    (ck / "step-0023").mkdir(parents=True)
    (ck / "step-0023" / "adapter.bin").write_bytes(os.urandom(1_500_000))
    (ck / "latest").write_text("step-0023")
    src = run / "arm" / "rl_run"
    first = cp.ship(src, work, tmp_path / "out-a", 0, run)
    assert first["groups"] >= 2 and first["left"] >= 1
    shutil.move(ck / "step-0023", ck / "step-0024")  # the run went on a step after that ship
    (ck / "latest").write_text("step-0024")
    with pytest.raises(cp.PartsError, match=r"changed since its group 0 was shipped.*--group 0"):
        cp.ship(src, work, tmp_path / "out-a", 1, run)
    returned = []
    for g in range(first["groups"]):  # shipped again from group 0: the parts are of the new state
        out = tmp_path / f"out-b{g}"
        cp.ship(src, work, out, g, run)
        returned += sorted(out.iterdir())
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    for f in returned:
        shutil.copy2(f, incoming / f.name)
    assert cp.restore(incoming, tmp_path / "far")["restored"] == ["arm/rl_run"]
    back = tmp_path / "far" / "arm" / "rl_run" / "checkpoints"
    assert (back / "latest").read_text() == "step-0024" and not (back / "step-0023").exists()
    # a part of the earlier state among the new ones is refused by name, nothing half-made left behind
    stale = tmp_path / "out-a" / "arm__rl_run.payload.tar.part-000"
    shutil.copy2(stale, incoming / stale.name)
    with pytest.raises(cp.PartsError, match=r"part-001: holds part 1 of pack carry:arm/rl_run:\w+; expected part 1 "
                                            r"of pack carry:arm/rl_run:\w+"):
        cp.restore(incoming, tmp_path / "far2")
    assert not (tmp_path / "far2" / "arm" / "rl_run").exists()


def test_a_tuned_model_goes_over_as_its_delta_from_the_base_and_comes_back_exactly(model_dir, tmp_path):
    # session 43: the SFT SmolLM2 crosses as its XOR from the embedded model (269 MB -> 100 MB, 18 calls -> 6)
    model, tok = load_model(str(model_dir))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():  # what fine-tuning does: every weight moves a little
            p.add_(1e-3 * torch.randn(p.shape, generator=g))
    tuned = tmp_path / "run" / "arm" / "tuned"
    model.save_pretrained(tuned)
    tok.save_pretrained(tuned)
    run = tmp_path / "run"
    plain = cp.ship(tuned, tmp_path / "w-plain", tmp_path / "o-plain", 0, run, bf16=True, part_bytes=40 << 20)
    res = cp.ship(tuned, tmp_path / "w-delta", tmp_path / "o-delta", 0, run, bf16=True, against="tiny-random",
                  part_bytes=40 << 20)
    assert res["bytes"] < 0.8 * plain["bytes"]
    assert json.loads((tmp_path / "o-delta" / f"arm__tuned.{cp.MANIFEST}").read_text())["against"] == "tiny-random"
    far = tmp_path / "far"
    assert cp.restore(tmp_path / "o-delta", far)["restored"] == ["arm/tuned"]
    assert not list((far / "arm" / "tuned").glob("*" + cp.DELTA))
    back, _ = load_model(str(far / "arm" / "tuned"))
    a = model.state_dict()
    for k, v in back.state_dict().items():
        assert torch.equal(v, a[k].to(torch.bfloat16).float()), k
    # parts made against another model are refused by name, nothing half-made left behind
    cp._refs["tiny-random"] = {k: v + 1 for k, v in cp._reference("tiny-random").items()}
    try:
        with pytest.raises(cp.PartsError, match=r"made against 'tiny-random' \(fingerprint \w+\), the reference "
                                                r"given is another"):
            cp.restore(tmp_path / "o-delta", tmp_path / "far2")
    finally:
        cp._refs.clear()
    assert not (tmp_path / "far2" / "arm" / "tuned").exists()


def test_a_plan_groups_carried_folders_into_the_fewest_calls_it_finds(tmp_path):
    sizes = {"a": 9, "b": 6, "c": 5, "d": 4, "e": 1}  # KiB
    for name, kib in sizes.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "part").write_bytes(b"x" * (kib << 10))
    res = cp.plan([tmp_path / n for n in sizes], 10 << 10)
    calls = [[Path(p).name for p in c] for c in res["calls"]]
    assert calls == [["a", "e"], ["b", "d"], ["c"]] and res["count"] == 3
    assert cp.main(["plan", str(tmp_path / "a"), "--max-mib", "1"]) == 0
    with pytest.raises(cp.PartsError, match=r"/a: 9216 bytes, more than a call carries"):
        cp.plan([tmp_path / "a"], 8 << 10)
    with pytest.raises(cp.PartsError, match="no such folder"):
        cp.plan([tmp_path / "zz"], 8 << 10)
    assert 0 < cp.call_room_bytes() < 64 << 20  # 64 MiB less the tree that travels now


def test_in_place_is_refused_once_rl_trained_from_the_weights(model_dir, tmp_path):
    """An SFT model rounded to bf16 in place after RL began would strand RL's checkpoints: they record the weights
    they started from and refuse to resume on others. `ship --in-place` is refused then, leaving the model as it
    was; without --in-place it ships."""
    before = {f.name: f.read_bytes() for f in model_dir.iterdir()}
    (model_dir.parent / "rl_run" / "checkpoints" / "step-0012").mkdir(parents=True)
    run, work = tmp_path / "run", tmp_path / "work"
    with pytest.raises(cp.PartsError, match=r"RL has already trained from these weights \(1 checkpoint"):
        cp.ship(model_dir, work, tmp_path / "out", 0, run, bf16=True, in_place=True)
    assert {f.name: f.read_bytes() for f in model_dir.iterdir()} == before
    res = cp.ship(model_dir, work, tmp_path / "out", 0, run, bf16=True)
    assert res["ship"] == "arm/sft_model" and {f.name: f.read_bytes() for f in model_dir.iterdir()} == before
