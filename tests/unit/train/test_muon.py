"""Muon + AdamW (train/muon.py): the orthogonalization, a toy problem, the trainer's use and exact resume."""

from __future__ import annotations

import copy

import pytest
import torch

from opencomposer.models.registry import load_model
from opencomposer.train import TrainConfig, Trainer
from opencomposer.train.checkpoint import load_checkpoint, save_checkpoint
from opencomposer.train.loss import LossConfig
from opencomposer.train.muon import MuonAdamW, orthogonalize, uses_muon

from testkit.train_data import params, rollout_samples


@pytest.mark.parametrize("shape, spike", [((64, 32), 50.0), ((32, 64), 50.0), ((48, 48), 1.0)])
def test_orthogonalize_puts_every_singular_value_near_one(shape, spike):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    g[:, 0] *= spike  # a spectrum far from flat (a square random matrix has a tiny one already)
    s = torch.linalg.svdvals(orthogonalize(g))
    assert s.max() < 1.25 and s.min() > (0.6 if spike > 1 else 0.1), (s.min(), s.max())
    assert (s > 0.6).float().mean() > 0.9  # all but the tiniest directions land near 1
    with pytest.raises(ValueError, match="takes a matrix"):
        orthogonalize(torch.randn(3, 4, 5))


def test_muon_fits_a_toy_regression():
    torch.manual_seed(0)
    w_true = torch.randn(16, 8)
    x = torch.randn(256, 8)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=True))
    opt = MuonAdamW(model.named_parameters(), lr=0.1)
    assert [g["muon"] for g in opt.param_groups] == [True, False]  # the weight to Muon, the bias to AdamW
    losses = []
    for i in range(200):
        for g in opt.param_groups:
            g["lr"] = 0.1 * (1 - i / 200)  # linear decay: Muon's steps do not shrink with the gradient
        loss = ((model(x) - x @ w_true.T) ** 2).mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < 1e-3 * losses[0], (losses[0], losses[-1])


def test_which_parameters_go_to_muon():
    assert uses_muon("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 4))
    assert not uses_muon("model.embed_tokens.weight", torch.zeros(4, 4))
    assert not uses_muon("lm_head.weight", torch.zeros(4, 4))
    assert not uses_muon("model.norm.weight", torch.zeros(4))


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_the_trainer_steps_with_muon_and_resumes_exactly(tmp_path, layout):
    cfg = TrainConfig(bf16=False, lr=1e-3, optimizer="muon", checkpoint_format=layout)
    a = Trainer(*load_model("tiny-random"), cfg)
    assert isinstance(a.optimizer, MuonAdamW)
    first, second = (rollout_samples(*a.policy_pair(), n=2, seed=k, max_new_tokens=8) for k in (1, 2))
    before = params(a.model)
    a.rl_step(first, LossConfig(), normalizer=16.0)
    a.rl_step(first, LossConfig(), normalizer=16.0)
    moved = params(a.model)
    assert all(not torch.equal(before[n], moved[n]) for n in before if "layers" in n and moved[n].ndim == 2)
    saved_opt = copy.deepcopy(a.optimizer.state_dict())
    save_checkpoint(tmp_path / "ckpt", a, {}, step=2)
    expected = a.rl_step(second, LossConfig(), normalizer=16.0)

    b = Trainer(*load_model("tiny-random"), cfg)
    load_checkpoint(tmp_path / "ckpt", b)
    got_opt = b.optimizer.state_dict()
    assert [g["params"] for g in got_opt["param_groups"]] == [g["params"] for g in saved_opt["param_groups"]]
    for k, st in saved_opt["state"].items():
        assert all(torch.equal(v, got_opt["state"][k][n]) for n, v in st.items() if isinstance(v, torch.Tensor))
    got = b.rl_step(second, LossConfig(), normalizer=16.0)
    assert (got["loss"], got["grad_norm"]) == (expected["loss"], expected["grad_norm"])
    after_a, after_b = params(a.model), params(b.model)
    assert all(torch.equal(after_a[n], after_b[n]) for n in after_a)
