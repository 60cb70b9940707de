"""Checkpoints: an interrupted run resumes bit-for-bit; bad files are named; exports load."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from opencomposer.models import load_model
from opencomposer.train.loss import LossConfig
from opencomposer.train import (CheckpointError, TrainConfig, Trainer, export_model, load_checkpoint, load_weights,
                                save_checkpoint)

from testkit.train_data import params, rollout_samples


def _flat(state: object) -> list:
    """Optimizer state as a flat list of tensors and numbers, for exact comparison."""
    if isinstance(state, dict):
        return [x for k in sorted(state, key=str) for x in [k, *_flat(state[k])]]
    if isinstance(state, (list, tuple)):
        return [x for v in state for x in _flat(v)]
    return [state]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b)
    )


@pytest.mark.parametrize("layout", ["full", "sharded"])
@pytest.mark.parametrize("lora", [False, True], ids=["full-ft", "lora"])
def test_resume_from_a_checkpoint_is_exact(tmp_path, lora, layout):
    cfg = TrainConfig(bf16=False, lr=1e-3, lora=lora, lora_r=4, checkpoint_format=layout)
    a = Trainer(*load_model("tiny-random"), cfg)
    first, second = (rollout_samples(*a.policy_pair(), n=2, seed=k, max_new_tokens=8) for k in (1, 2))
    loss = LossConfig(kl_coef=0.05 if lora else 0.0)
    a.rl_step(first, loss, normalizer=16.0)
    a.rl_step(first, loss, normalizer=16.0)  # two steps, so AdamW's moments are not trivial
    saved_weights, saved_opt = params(a.model), _flat(copy.deepcopy(a.optimizer.state_dict()))
    state = {"used_task_ids": ["t0", "t1"], "metrics": [{"loss": 0.5}]}
    save_checkpoint(tmp_path / "ckpt", a, state, step=2)
    torch.manual_seed(123)  # whatever happens after the save...
    expected = a.rl_step(second, loss, normalizer=16.0)
    expected_rng = torch.rand(3)

    b = Trainer(*load_model("tiny-random"), cfg.model_copy(update={"checkpoint_format": "full"}))  # read as found
    got_state = load_checkpoint(tmp_path / "ckpt", b)
    assert got_state == {**state, "step": 2} and b.version == 2
    restored = params(b.model)
    assert all(torch.equal(saved_weights[n], restored[n]) for n in saved_weights)
    assert _same(saved_opt, _flat(b.optimizer.state_dict()))
    torch.manual_seed(123)
    got = b.rl_step(second, loss, normalizer=16.0)
    assert torch.equal(torch.rand(3), expected_rng)
    assert (got["loss"], got["grad_norm"]) == (expected["loss"], expected["grad_norm"])
    after_a, after_b = params(a.model), params(b.model)
    assert all(torch.equal(after_a[n], after_b[n]) for n in after_a)


def test_latest_pointer_and_pruning(tmp_path, tiny):
    trainer = Trainer(*tiny, TrainConfig(bf16=False))
    for step in range(1, 5):
        save_checkpoint(tmp_path, trainer, {"n": step}, step=step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-0003", "step-0004"]
    assert (tmp_path / "latest").read_text().strip() == "step-0004"
    assert load_checkpoint(tmp_path, trainer)["n"] == 4
    assert load_checkpoint(tmp_path / "step-0003", trainer)["n"] == 3  # a step dir directly
    save_checkpoint(tmp_path, trainer, {"n": 44}, step=4, keep=2)  # re-saving a step replaces it
    assert load_checkpoint(tmp_path, trainer)["n"] == 44
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        save_checkpoint(tmp_path, trainer, {"bad": object()}, step=5)


def test_milestones_keep_their_weights_without_optimizer_state(tmp_path, tiny):
    trainer = Trainer(*tiny, TrainConfig(bf16=False))
    weights = {}
    for step in range(1, 9):
        with torch.no_grad():  # a different model each step, so each milestone holds its own
            next(trainer.model.parameters()).add_(1.0)
        weights[step] = params(trainer.model)
        save_checkpoint(tmp_path, trainer, {"n": step}, step=step, keep=2, keep_every=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-0003", "step-0006", "step-0007", "step-0008"]
    assert (tmp_path / "step-0007" / "optimizer.pt").is_file()  # the newest two: whole
    for step in (3, 6):
        assert not (tmp_path / f"step-{step:04d}" / "optimizer.pt").exists()
        got = params(load_model(str(tmp_path / f"step-{step:04d}" / "model"))[0])
        assert all(torch.equal(got[n], weights[step][n]) for n in got)
    with pytest.raises(CheckpointError, match="optimizer.pt"):  # a milestone is read, not resumed
        load_checkpoint(tmp_path / "step-0003", trainer)
    opt = _flat(copy.deepcopy(trainer.optimizer.state_dict()))
    assert load_weights(tmp_path / "step-0003", trainer) == 3  # its weights alone
    got = params(trainer.model)
    assert all(torch.equal(got[n], weights[3][n]) for n in got) and _same(opt, _flat(trainer.optimizer.state_dict()))
    lora = Trainer(*load_model("tiny-random"), TrainConfig(bf16=False, lora=True, lora_r=4))
    with pytest.raises(CheckpointError, match="lora=False, trainer lora=True"):
        load_weights(tmp_path / "step-0003", lora)


def test_a_lora_milestone_is_read_into_another_trainer(tmp_path):
    cfg = TrainConfig(bf16=False, lora=True, lora_r=4)
    a = Trainer(*load_model("tiny-random"), cfg)
    saved = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            for n, p in a.model.named_parameters():
                if "lora_" in n:
                    p.add_(0.01 * step)
        saved[step] = {n: t.clone() for n, t in params(a.model).items() if "lora_" in n}
        save_checkpoint(tmp_path, a, {}, step=step, keep=1, keep_every=2)
    b = Trainer(*load_model("tiny-random"), cfg)
    assert load_weights(tmp_path / "step-0002", b) == 2
    got = params(b.model)
    assert saved[2] and all(torch.equal(got[n], t) for n, t in saved[2].items())


def test_bad_checkpoints_name_the_file(tmp_path, tiny):
    trainer = Trainer(*tiny, TrainConfig(bf16=False))
    with pytest.raises(CheckpointError, match=r"nothing[/\\]latest: missing"):
        load_checkpoint(tmp_path / "nothing", trainer)
    path = save_checkpoint(tmp_path, trainer, {}, step=1)
    weights = next((path / "model").glob("*.safetensors"))
    weights.write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match=f"{weights.name}: unreadable safetensors"):
        load_checkpoint(tmp_path, trainer)

    path = save_checkpoint(tmp_path, trainer, {}, step=2)
    (path / "optimizer.pt").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="optimizer.pt: unreadable"):
        load_checkpoint(tmp_path, trainer)
    (path / "state.json").write_text("{")
    with pytest.raises(CheckpointError, match="state.json: not valid JSON"):
        load_checkpoint(tmp_path, trainer)
    (tmp_path / "latest").write_text("step-0099\n")
    with pytest.raises(CheckpointError, match="points to 'step-0099'"):
        load_checkpoint(tmp_path, trainer)

    path = save_checkpoint(tmp_path, trainer, {}, step=3)
    lora = Trainer(*load_model("tiny-random"), TrainConfig(bf16=False, lora=True))
    with pytest.raises(CheckpointError, match="trainer.json: checkpoint is full fine-tuning but the trainer is set up for LoRA"):
        load_checkpoint(tmp_path, lora)
    assert json.loads((path / "trainer.json").read_text())["model"].endswith("tiny-random")


def test_a_damaged_sharded_checkpoint_names_the_directory_and_what_is_missing(tmp_path):
    cfg = TrainConfig(bf16=False, lora=True, lora_r=4, checkpoint_format="sharded")
    trainer = Trainer(*load_model("tiny-random"), cfg)
    trainer.rl_step(rollout_samples(*trainer.policy_pair(), n=2, max_new_tokens=4), LossConfig(), normalizer=8.0)
    shards = save_checkpoint(tmp_path, trainer, {}, step=1) / "shards"
    other = Trainer(*load_model("tiny-random"), cfg.model_copy(update={"lora_r": 8}))
    with pytest.raises(CheckpointError, match=r"step-0001[/\\]shards: does not fit this trainer's parameters: .*lora"):
        load_checkpoint(tmp_path, other)
    data = next(shards.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"step-0001[/\\]shards: shard files cut short: {data.name} \(of the 1"):
        load_checkpoint(tmp_path, trainer)
    data.unlink()
    with pytest.raises(CheckpointError, match=rf"shards: shard files missing: {data.name}"):
        load_checkpoint(tmp_path, trainer)
    (shards / ".metadata").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match=r"shards[/\\].metadata: unreadable"):
        load_checkpoint(tmp_path, trainer)
    (shards / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"step-0001[/\\]shards: no .metadata .* incomplete"):
        load_checkpoint(tmp_path, trainer)


def test_a_failed_sharded_save_leaves_the_previous_checkpoint_newest(tmp_path, tiny, monkeypatch):
    """Before the first step there is no AdamW state to save (nor one made up); a save that
    fails halfway leaves neither a step directory nor a temp dir behind."""
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    trainer = Trainer(*tiny, TrainConfig(bf16=False, checkpoint_format="sharded"))
    save_checkpoint(tmp_path, trainer, {"n": 0}, step=0)
    assert not trainer.optimizer.state
    assert load_checkpoint(tmp_path, trainer)["n"] == 0 and not trainer.optimizer.state

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_FileSystemWriter, "write_data", full_disk)
    with pytest.raises(CheckpointError, match=r"step-0001: could not write the sharded checkpoint \(rank 0: OSError"):
        save_checkpoint(tmp_path, trainer, {"n": 1}, step=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-0000"]


def test_export_merges_lora_into_a_loadable_model(tmp_path, tiny):
    trainer = Trainer(*tiny, TrainConfig(bf16=False, lr=1e-2, lora=True, lora_r=4))
    trainer.rl_step(rollout_samples(*trainer.policy_pair(), n=2), LossConfig(), normalizer=32.0)
    out = export_model(tmp_path / "model", trainer)
    model, _ = load_model(str(out))
    ids = torch.tensor([rollout_samples(model, trainer.tokenizer, n=1)[0].input_ids])
    with torch.no_grad():
        mine, theirs = trainer.model(input_ids=ids).logits, model(input_ids=ids).logits
        base = load_model("tiny-random")[0](input_ids=ids).logits
    torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(base, mine, atol=1e-5)  # the export carries the training
    assert any("lora_" in n for n, _ in trainer.model.named_parameters())  # adapters intact


@pytest.mark.parametrize("layout", ["full", "sharded"])
@pytest.mark.parametrize("lora", [False, True], ids=["full-ft", "lora"])
def test_a_checkpoint_of_either_layout_exports_as_the_trainers_model(tmp_path, lora, layout):
    """``opencomposer export`` (``export_checkpoint``): weights only, in one process, LoRA merged:
    the export computes what the trainer's model computes; a wrong path is named."""
    from typer.testing import CliRunner

    from opencomposer.cli import app

    trainer = Trainer(*load_model("tiny-random"), TrainConfig(bf16=False, lr=1e-2, lora=lora, lora_r=4,
                                                              checkpoint_format=layout))
    samples = rollout_samples(*trainer.policy_pair(), n=2)
    trainer.rl_step(samples, LossConfig(), normalizer=32.0)
    save_checkpoint(tmp_path / "ckpt", trainer, {}, step=1)
    r = CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "model")])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])  # (stderr: the loaders' progress bars)
    assert (res["step"], res["layout"], res["lora"]) == (1, layout, lora) and res["model"].endswith("tiny-random")
    exported, _ = load_model(res["exported"])
    ids = torch.tensor([samples[0].input_ids])
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, trainer.model(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-5)
        assert not torch.allclose(load_model("tiny-random")[0](input_ids=ids).logits, exported(input_ids=ids).logits,
                                  atol=1e-5)  # the export carries the training
    bad = CliRunner().invoke(app, ["export", str(tmp_path), "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "holds no checkpoint" in json.loads(bad.stdout.strip().splitlines()[-1])["error"]


KILLED_SAVE = r"""
import os, signal, sys
from pathlib import Path
from opencomposer.train.checkpoint_files import _new_temp
tmp = _new_temp(Path(sys.argv[1]) / "step-0007")
(tmp / "optimizer.pt").write_bytes(b"half")
print(tmp, flush=True)
if sys.argv[2] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()  # the live owner: holds on until the test closes its stdin
"""


def test_a_killed_save_leaves_a_temp_dir_the_next_save_and_load_remove(tmp_path, tiny):
    import subprocess
    import sys

    def start(mode: str) -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(tmp_path), mode],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return proc, proc.stdout.readline().strip()

    dead, dead_tmp = start("die")
    assert dead.wait(30) == -9
    live, live_tmp = start("live")
    try:
        trainer = Trainer(*tiny, TrainConfig(bf16=False))
        save_checkpoint(tmp_path, trainer, {"n": 1}, step=1)
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == sorted(["latest", "step-0001", live_tmp.rsplit("/", 1)[-1]]), names
        dead, dead_tmp = start("die")  # killed again: now the next load clears it
        assert dead.wait(30) == -9
        assert load_checkpoint(tmp_path, trainer)["n"] == 1
        assert not os.path.exists(dead_tmp) and os.path.isdir(live_tmp)  # a live owner's temp is kept
    finally:
        live.communicate("")
