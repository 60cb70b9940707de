"""Run under torchrun (2 gloo ranks, or NCCL ranks) by tests/distributed/test_distributed.py and
tests/gpu/test_distributed_cuda.py: trainer steps on a sharded tiny-random model; rank 0 writes
what came out for the test to compare with one process.

    torchrun --standalone --nproc-per-node 2 tests/testkit/dist_worker.py steps DATA OUT

The tests launch it with ``torchrun`` and compare with ``assert_same`` (both below).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from opencomposer.models import load_model
from opencomposer.train.loss import LossConfig
from opencomposer.train import CheckpointError, TrainConfig, Trainer, export_model, frozen_copy, load_checkpoint, save_checkpoint
from opencomposer.train.distributed import _leave, init_from_env, on_main, rank_device, shard_model


def test_model(device: str):
    """tiny-random (its tokenizer comes from the embedded GGUF), or with OC_TEST_MODEL=random the
    random 'tiny' Qwen2 shape and a small word-level tokenizer: what a GPU host without the
    GGUF can build."""
    if os.environ.get("OC_TEST_MODEL", "tiny-random") == "tiny-random":
        return load_model("tiny-random", device=device)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from opencomposer.bench.toolkit import random_model

    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, 512)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                  pad_token="<pad>", unk_token="<unk>")
    return random_model("tiny", device, torch.float32, seed=0).train(False), tok


def steps(trainer: Trainer, data: dict, ref=None) -> list[dict]:
    """One GRPO + feedback-distillation update, then one SFT update: what every scenario runs;
    with a reference model, the GRPO loss has a k1 KL term."""
    m = trainer.rl_backward(data["samples"], LossConfig(kl_coef=0.1 if ref is not None else 0.0),
                            data["normalizer"], ref)
    m.update(trainer.distill_backward(data["pairs"], 0.5, data["normalizer"]))
    m.update(trainer.optimizer_step())
    return [m, trainer.sft_step(data["samples"])]


def _save_on_a_full_disk(trainer: Trainer, ckpt: Path, full: bool) -> str:
    """save_checkpoint at step 2 where writing fails on this rank if ``full``: what each rank raised."""
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    def write_data(*args, **kwargs):
        raise OSError(28, "No space left on device")

    real = _FileSystemWriter.write_data
    if full:
        _FileSystemWriter.write_data = write_data
    try:
        save_checkpoint(ckpt, trainer, {"note": "never"}, step=2)
        return "saved"
    except CheckpointError as e:
        return str(e)
    finally:
        _FileSystemWriter.write_data = real


def main(scenario: str, data_file: str, out: str) -> None:
    torch.set_num_threads(1)
    device = os.environ.get("OC_TEST_DEVICE", "cpu")  # tests/gpu runs it on CUDA (NCCL)
    d = init_from_env(device)
    if scenario == "on_main":  # rank 0 returns, then fails: every rank says what it got
        got = on_main(d, lambda: {"from": "rank 0"}, "first")

        def fail() -> None:
            raise OSError("disk full")

        try:
            on_main(d, fail, "rank 0 could not write", ValueError)
        except (OSError, ValueError) as e:
            got["raised"] = f"{type(e).__name__}: {e}"
        torch.save(got, Path(out) / f"on_main-{d.rank}.pt")
        return
    device = str(rank_device(d, device))
    data = torch.load(data_file, weights_only=False)
    if scenario == "leave":  # sharded steps, then what a rank's exit runs: the threads left after it
        steps(Trainer(*test_model(device), TrainConfig(**data["cfg"]), dist=d), data)
        _leave()
        threads = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
        torch.save({"threads": threads}, Path(out) / ("leave.pt" if d.main else f"leave-{d.rank}.pt"))
        return
    model, tok = test_model(device)
    trainer = Trainer(model, tok, TrainConfig(**data["cfg"]), dist=d)
    out_dir = Path(out)
    result: dict = {"world": d.world, "sharded_params": sum(p.to_local().numel() for p in trainer.params)}
    if scenario == "steps":
        result["metrics"] = steps(trainer, data)
    elif scenario == "kl":  # the reference sharded as the RL run shards it (rl/run.py: reference)
        ref = shard_model(frozen_copy(test_model(device)[0]), d, trainer.device, trainer.bf16)
        result["metrics"] = steps(trainer, data, ref) + steps(trainer, data, ref)
    elif scenario == "save":  # steps, a checkpoint, steps again, an export
        result["metrics"] = steps(trainer, data)
        save_checkpoint(out_dir / "ckpt", trainer, {"note": "from 2 ranks"}, step=1)
        result["metrics"] += steps(trainer, data)
        export_model(out_dir / "model", trainer)
    elif scenario == "save_first":  # a checkpoint before any step (no AdamW state yet), then steps
        save_checkpoint(out_dir / "ckpt0", trainer, {"note": "before any step"}, step=0)
        result["metrics"] = steps(trainer, data)
    elif scenario == "save_fails":  # a good checkpoint, one that rank 1 cannot write, a damaged one
        result["metrics"] = steps(trainer, data)
        save_checkpoint(out_dir / "ckpt", trainer, {"note": "good"}, step=1)
        result["errors"] = [_save_on_a_full_disk(trainer, out_dir / "ckpt", d.rank == 1)]
        torch.distributed.barrier()
        if d.main:  # one rank's shard file lost
            next((out_dir / "ckpt" / "step-0001" / "shards").glob("__1_*.distcp")).unlink()
        torch.distributed.barrier()
        try:
            load_checkpoint(out_dir / "ckpt", trainer)
        except CheckpointError as e:
            result["errors"].append(str(e))
        torch.save(result["errors"], out_dir / f"errors-{d.rank}.pt")
    elif scenario == "resume":  # a checkpoint (from any world size), then steps
        result["state"] = load_checkpoint(data["checkpoint"], trainer)
        result["version"] = trainer.version
        result["metrics"] = steps(trainer, data)
    weights = trainer.full_state_dict()
    if d.main:
        torch.save({**result, "weights": weights}, out_dir / f"{scenario}.pt")


# for the tests that launch this script

WORKER = Path(__file__)


def torchrun(scenario: str, data: dict, tmp: Path, nproc: int = 2, device: str = "cpu",
             model: str = "tiny-random") -> dict:
    """This script's ``scenario`` on ``nproc`` ranks over ``data`` (saved under ``tmp``): rank 0's result."""
    torch.save(data, tmp / "data.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OC_TEST_DEVICE": device, "OC_TEST_MODEL": model}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(WORKER), scenario, str(tmp / "data.pt"), str(tmp)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp / f"{scenario}.pt", weights_only=False)


def assert_same(weights: dict, trainer: Trainer, atol: float = 1e-5) -> None:
    """``weights`` (a full state dict) equal ``trainer``'s model's, to ``atol``."""
    mine = trainer.model.state_dict()
    assert set(weights) == set(mine)
    worst = max(float((weights[k].cpu() - mine[k].cpu()).abs().max()) for k in mine)
    assert worst < atol, f"max |difference| {worst:.2e}"


if __name__ == "__main__":
    main(*sys.argv[1:4])
