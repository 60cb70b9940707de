"""The FSDP2 trainer over NCCL on 2 GPUs against one GPU: the same update in fp32, the same
losses in bf16 (all-gathers in bf16, fp32 reduction), and a checkpoint gathered from CUDA
shards that resumes in one process. The CPU twin (gloo) is tests/distributed/test_distributed.py;
both run tests/testkit/dist_worker.py.

Run on a host with 2+ GPUs: ``python3 -m pytest -q tests/gpu/test_distributed_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


@pytest.fixture(scope="module")
def data():
    """Five sequences of uneven length (the ranks' shares need different pass counts) with
    fixed sampler logprobs, and feedback pairs; random tokens of the 'tiny' shape's vocabulary."""
    from opencomposer.train.samples import Sample

    g = torch.Generator().manual_seed(0)
    samples = []
    for i, n in enumerate((40, 31, 25, 18, 12)):
        ids = torch.randint(2, 512, (n,), generator=g).tolist()
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        samples.append(Sample(ids, mask, [-5.0 * m for m in mask], advantage=1.0 if i % 2 == 0 else -0.5))
    pairs = [(s, Sample([7, 8, 9] + s.input_ids, [0, 0, 0] + s.loss_mask, [0.0] * 3 + s.old_logprobs))
             for s in samples[:3]]
    return {"samples": samples, "pairs": pairs, "normalizer": 200.0,
            "cfg": {"bf16": False, "lr": 1e-3, "temperature": 1.0, "micro_batch_tokens": 64}}


def one_gpu(data: dict):
    from opencomposer.train import TrainConfig, Trainer
    from opencomposer.train.distributed import SINGLE
    from testkit.dist_worker import steps, test_model

    trainer = Trainer(*test_model("cuda"), TrainConfig(**data["cfg"]), dist=SINGLE)
    return trainer, steps(trainer, data)


def test_two_gpus_make_the_one_gpu_update_in_fp32_and_bf16(data, tmp_path, monkeypatch):
    from testkit.dist_worker import assert_same, torchrun

    monkeypatch.setenv("OC_TEST_MODEL", "random")
    got = torchrun("steps", data, tmp_path, device="cuda", model="random")
    trainer, metrics = one_gpu(data)
    assert got["metrics"][0]["grad_norm"] > 0
    for mine, theirs in zip(metrics, got["metrics"]):
        for key in ("loss", "grad_norm", "distill_kl"):
            if key in mine:
                assert theirs[key] == pytest.approx(mine[key], rel=1e-4, abs=1e-6), key
    assert_same(got["weights"], trainer, atol=1e-4)

    bf16 = {**data, "cfg": {**data["cfg"], "bf16": True}}
    got = torchrun("steps", bf16, tmp_path, device="cuda", model="random")
    _, metrics = one_gpu(bf16)
    for mine, theirs in zip(metrics, got["metrics"]):  # bf16 all-gathers and compute: its rounding, not more
        assert theirs["loss"] == pytest.approx(mine["loss"], rel=2e-2, abs=1e-4)


def test_a_checkpoint_of_two_gpus_resumes_on_one(data, tmp_path, monkeypatch):
    from opencomposer.train import TrainConfig, Trainer, load_checkpoint
    from opencomposer.train.distributed import SINGLE
    from testkit.dist_worker import assert_same, steps, test_model, torchrun

    monkeypatch.setenv("OC_TEST_MODEL", "random")
    got = torchrun("save", data, tmp_path, device="cuda", model="random")
    trainer = Trainer(*test_model("cuda"), TrainConfig(**data["cfg"]), dist=SINGLE)
    assert load_checkpoint(tmp_path / "ckpt", trainer)["note"] == "from 2 ranks" and trainer.version == 2
    steps(trainer, data)
    assert_same(got["weights"], trainer, atol=1e-4)
