"""MTP heads (``models/mtp.py``) and their self-distillation (``train/mtp.py``) on tiny-random
with real source files: the head learns, runs resume, files are checked, bad data is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from opencomposer.models.mtp import MTPError, MTPHead
from opencomposer.train.mtp import (
    chain_losses,
    head_for,
    read_corpus,
    train_mtp,
    windows,
)

SRC = Path(__file__).resolve().parents[3] / "src" / "opencomposer"


@pytest.fixture
def code(tmp_path) -> Path:
    """A few real source files of this project (about 20k tokens)."""
    d = tmp_path / "code"
    d.mkdir()
    for f in sorted((SRC / "sync").glob("*.py")):
        shutil.copy(f, d / f.name)
    (d / "notes.bin").write_bytes(b"\x00\x01")  # not a text suffix: skipped inside a directory
    return d


def test_self_distillation_brings_the_head_towards_the_model(code, tmp_path):
    # the whole vocabulary: tiny-random's next-token distributions are nearly uniform over all of it
    res = train_mtp("tiny-random", [code], tmp_path / "run", steps=12, depth=2, lr=3e-3, seq_len=48,
                    save_every=5, draft_vocab=0, progress=False)
    assert res["steps"] == 12 and res["depth"] == 2 and res["resumed_from"] == 0
    # held-out windows: the KL to the model falls at both draft depths, and acceptance rises
    assert all(a < b for a, b in zip(res["kl"], _before_kl(tmp_path / "run"))), res
    assert res["acceptance"][0] > res["acceptance_before"][0]
    head = MTPHead.load(res["head"], 64, 49152)
    assert head.cfg.trained["steps"] == 12 and head.cfg.trained["acceptance"] == res["acceptance"]
    assert head.cfg.base_model == "tiny-random"


def _before_kl(run: Path) -> list[float]:
    return json.loads((run / "checkpoint" / "state.json").read_text())["history"]["before"]["kl"]


def test_a_run_resumes_from_its_checkpoint(code, tmp_path):
    first = train_mtp("tiny-random", [code], tmp_path / "run", steps=4, depth=1, seq_len=32, save_every=2,
                      draft_vocab=512, progress=False)
    head = MTPHead.load(tmp_path / "run" / "head")
    assert head.cfg.draft_vocab_size == first["draft_vocab"] == 512 and head.draft_vocab.shape == (512,)
    assert 0.5 < first["draft_vocab_coverage"] < 1  # 512 of 49,152 ids carry most of the code's tokens
    state = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 4 and len(state["history"]["loss"]) == 4
    second = train_mtp("tiny-random", [code], tmp_path / "run", steps=7, depth=1, seq_len=32, save_every=2,
                       draft_vocab=512, progress=False)
    assert second["resumed_from"] == 4 and second["first_loss"] == first["first_loss"]
    state = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 7 and len(state["history"]["loss"]) == 7
    assert second["acceptance_before"] == first["acceptance_before"]  # measured once, before step 1


def test_the_chain_trains_every_draft_depth(tiny):
    model, _ = tiny
    model.requires_grad_(False)  # as train_mtp freezes it
    head = head_for(model)
    ids = torch.randint(0, 49152, (2, 20))
    rows = chain_losses(model, head, ids, depth=3)
    assert len(rows) == 3
    sum(r["kl"] for r in rows).backward()
    assert head.proj.weight.grad is not None and head.proj.weight.grad.abs().sum() > 0


def test_a_head_round_trips_and_misfits_are_named(tiny, tmp_path):
    model, _ = tiny
    head = head_for(model, base_model="tiny-random")
    torch.nn.init.normal_(head.down.weight, std=0.1)
    head.save(tmp_path / "h")
    head.save(tmp_path / "h")  # replacing a saved head is atomic too
    again = MTPHead.load(tmp_path / "h", 64, 49152)
    x, e = torch.randn(3, 64), torch.randn(3, 64)
    assert torch.equal(head(x, e), again(x, e))
    with pytest.raises(MTPError, match="vocab_size=49152 but the model it would draft for has vocab_size=97"):
        MTPHead.load(tmp_path / "h", 64, 97)
    (tmp_path / "h" / "mtp.json").write_text("{not json")
    with pytest.raises(MTPError, match="mtp.json: not an MTP head config"):
        MTPHead.load(tmp_path / "h")
    with pytest.raises(MTPError, match="no such file"):
        MTPHead.load(tmp_path / "missing")


def test_bad_data_is_named(tiny, tmp_path, code):
    _, tok = tiny
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        read_corpus([tmp_path / "nowhere"], tok)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "def f(): pass"}\n{"txt": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object with a \"text\" string"):
        read_corpus([bad], tok)
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "def f(): pass"}\n\n{"text": "x = 1"}\n')
    assert len(read_corpus([good], tok)) == 2
    assert len(read_corpus([code], tok)) == len(list(code.glob("*.py")))  # the .bin file skipped
    small = tmp_path / "small.py"
    small.write_text("x = 1\n")
    with pytest.raises(ValueError, match="make 0 windows of seq_len=64"):
        train_mtp("tiny-random", [small], tmp_path / "run", steps=2, seq_len=64, progress=False)
    assert windows([[1, 2, 3], [4, 5]], 3, 0) == [[1, 2, 3], [0, 4, 5]]
