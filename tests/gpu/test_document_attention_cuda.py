"""Packed rows' document attention on CUDA (``train/document_attention.py``): the compiled
FlexAttention kernel gives the SDPA loop's outputs and gradients (fp32, GQA, shared prefixes, two
rows of different layouts, rows of several lengths through one compiled function), and a trainer's
step with ``[train] document_attention = "flex"`` (what "auto" picks here) gives the "sdpa" one's
loss and gradients.

Run on a GPU box: ``PYTHONPATH=src python -m pytest -q tests/gpu/test_document_attention_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

from opencomposer.bench.train import rl_like_samples
from opencomposer.models import load_model
from opencomposer.train import TrainConfig, Trainer
from opencomposer.train.document_attention import attention_kind, document_flex, document_sdpa

from testkit.train_data import grads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _row(*pieces: range) -> list[int]:
    return [p for r in pieces for p in r]


@pytest.mark.parametrize("rows", [
    [_row(range(140), range(10, 14), range(13, 60), range(70), range(5, 44), range(60, 61))],
    [_row(range(300), range(3, 100)), _row(range(200), range(90), range(3, 13), range(89, 186))],
    [_row(range(700), range(500, 900), range(1000))],
])
def test_flex_gives_the_sdpa_loops_outputs_and_gradients(rows):
    pos = torch.tensor(rows, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(len(rows), 8, pos.shape[1], 64, device="cuda", generator=g, requires_grad=True)
    k, v = (torch.randn(len(rows), 2, pos.shape[1], 64, device="cuda", generator=g, requires_grad=True)
            for _ in range(2))
    up = torch.randn(len(rows), pos.shape[1], 8, 64, device="cuda", generator=g)
    results = []
    for attend in (document_sdpa, document_flex):
        out, _ = attend(None, q, k, v, None, scaling=0.1, position_ids=pos)
        results.append((out, *torch.autograd.grad((out * up).sum(), (q, k, v))))
    for name, want, got in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)


def test_a_flex_step_gives_the_sdpa_steps_loss_and_gradients():
    assert attention_kind("auto", torch.device("cuda")) == "flex"
    assert attention_kind("auto", torch.device("cuda"), shared_prefixes=False) == "sdpa"  # whole documents: flash
    trainers = {kind: Trainer(*load_model("tiny-random", device="cuda"),
                              TrainConfig(bf16=False, micro_batch_tokens=2048, document_attention=kind))
                for kind in ("sdpa", "flex")}
    samples = rl_like_samples(3000, trainers["sdpa"].model.config.vocab_size, seed=0, scale=0.2, k=4)
    assert any(trainers["flex"]._collate(mb).computed < trainers["flex"]._collate(mb).tokens
               for mb in trainers["flex"]._micro_batches(samples))  # shared prefixes in the rows
    m = {kind: t.sft_backward(samples, normalizer=1000.0) for kind, t in trainers.items()}
    assert m["flex"]["loss"] == pytest.approx(m["sdpa"]["loss"], rel=1e-5)
    want, got = grads(trainers["sdpa"].model), grads(trainers["flex"].model)
    assert want.keys() == got.keys() and want
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5, msg=n)
