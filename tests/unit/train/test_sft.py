"""``run_sft`` end to end: oracle-like transcripts on disk -> a trained, exported tiny model."""

from __future__ import annotations

import pytest

from opencomposer.models import load_model
from opencomposer.train import TrainConfig, load_checkpoint, run_sft
from opencomposer.train.trainer import Trainer


def test_run_sft_trains_saves_and_exports(tmp_path, transcripts):
    out = tmp_path / "sft"
    result = run_sft(transcripts[:1], "tiny-random", out, TrainConfig(bf16=False, lr=3e-3), epochs=3, batch_size=1, progress=False)
    assert (result["transcripts"], result["samples"], result["steps"], result["dropped_too_long"]) == (1, 1, 3, 0)
    assert result["last_loss"] < result["first_loss"] - 0.5, result["losses"]
    assert result["tokens_per_second"] > 0
    model, tok = load_model(result["export"])  # a plain HF directory
    trainer = Trainer(*load_model("tiny-random"), TrainConfig(bf16=False, lr=3e-3))
    state = load_checkpoint(out / "checkpoints", trainer)
    assert state["step"] == 3 and state["losses"] == result["losses"]


def test_run_sft_refuses_transcripts_without_turns(tmp_path, transcripts):
    from opencomposer.harness.trajectory import Trajectory

    empty = Trajectory.load(transcripts[0])
    empty.messages, empty.steps = empty.messages[:2], []
    with pytest.raises(ValueError, match="no trainable assistant turns in 1 transcripts"):
        run_sft([empty], "tiny-random", tmp_path / "x", progress=False, save=False)
