"""Muon for the matrices of the hidden layers, AdamW for everything else, as one optimizer.

    opt = MuonAdamW(named_parameters, lr=1e-4, weight_decay=0.0)   # TrainConfig.optimizer = "muon"

Muon (momentum orthogonalized by Newton-Schulz) updates each 2-D weight of the hidden layers
with the nearest semi-orthogonal matrix to its (Nesterov) momentum: every direction of the
update moves by the same amount, whatever the gradient's spectrum. The orthogonalization is
five steps of the quintic Newton-Schulz iteration ``X <- a X + (b A + c A^2) X`` with
``A = X X^T`` and the published coefficients (a, b, c) = (3.4445, -4.7750, 2.0315), run in
the gradient's dtype after scaling ``X`` to unit Frobenius norm; its singular values land
near 1 (between about 0.68 and 1.2; only directions far weaker than the strongest stay below),
which is all Muon needs. Its steps do not shrink with the gradient, so only a decaying learning
rate lets it settle on a minimum (the toy test decays it; the trainer's schedule is a warm-up then
a constant rate).

The update is scaled by ``0.2 * sqrt(max(rows, cols))`` so its RMS matches AdamW's (Moonshot's
"Muon is scalable for LLM training"): one learning rate serves both parts, and a run can switch
optimizer without re-tuning it from nothing. Weight decay is decoupled (as AdamW's).

Which parameters go to Muon: 2-D, trainable, and not an embedding or the output head (their
rows are tokens, not directions of a hidden space); everything else (norms, biases, embeddings,
the head) goes to AdamW. One ``torch.optim.Optimizer`` holds both, as param groups flagged
``muon``, so the trainer's schedule, ``state_dict`` and checkpoints treat it like AdamW.

Sharded (FSDP2, torchrun) training: a hidden matrix's parameter, gradient and momentum are
DTensors split by rows over the ranks. The momentum stays sharded (each rank updates its rows);
the Nesterov term is all-gathered (``full_tensor``), orthogonalized whole on every rank (the same
computation everywhere: redundant work, cheap at small world sizes; handing each matrix to one
rank and scattering the results is not built), and each rank applies its own rows. Two gloo
ranks make the single-process update (``tests/distributed/test_distributed.py``).

Test: ``pytest tests/unit/train/test_muon.py tests/distributed/test_distributed.py -k muon``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
RMS_MATCH = 0.2  # Muon's update RMS scaled to AdamW's typical 0.2-0.4
NOT_MUON = ("embed", "lm_head", "wte", "wpe", "output")


def orthogonalize(g: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """The semi-orthogonal matrix nearest ``g`` (2-D), approximately: quintic Newton-Schulz."""
    if g.ndim != 2:
        raise ValueError(f"orthogonalize takes a matrix, got a tensor of shape {tuple(g.shape)}")
    a, b, c = NS_COEFFICIENTS
    x = g / (g.norm() + eps)
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the wide side: A = X X^T is the smaller Gram matrix
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def uses_muon(name: str, p: torch.Tensor) -> bool:
    """Whether a trainable parameter is a hidden-layer matrix (Muon) or not (AdamW)."""
    return p.ndim == 2 and not any(k in name for k in NOT_MUON)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the hidden matrices, AdamW on the rest (see the module docstring)."""

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]], lr: float, *, momentum: float = 0.95,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        named = [(n, p) for n, p in named_params if p.requires_grad]
        muon = [p for n, p in named if uses_muon(n, p)]
        adam = [p for n, p in named if not uses_muon(n, p)]
        groups = [g for g in ({"params": muon, "muon": True}, {"params": adam, "muon": False}) if g["params"]]
        if not groups:
            raise ValueError("no trainable parameters")
        super().__init__(groups, {"lr": lr, "momentum": momentum, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay, "muon": False})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 -- torch's signature
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if wd:
                    p.mul_(1.0 - lr * wd)
                if group["muon"]:
                    self._muon(p, group, lr)
                else:
                    self._adamw(p, group, lr)
        return loss

    def _muon(self, p: torch.Tensor, group: dict, lr: float) -> None:
        state = self.state[p]
        buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
        mu = group["momentum"]
        buf.mul_(mu).add_(p.grad)
        nesterov = p.grad.add(buf, alpha=mu)  # the gradient plus the new momentum
        if isinstance(nesterov, DTensor):  # sharded (FSDP2): Newton-Schulz needs the whole matrix
            whole = orthogonalize(nesterov.full_tensor())  # an all-gather; every rank computes the same
            update = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)  # its own shard
        else:
            update = orthogonalize(nesterov)
        p.add_(update, alpha=-lr * RMS_MATCH * max(p.shape) ** 0.5)  # p.shape: the whole matrix's

    def _adamw(self, p: torch.Tensor, group: dict, lr: float) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        b1, b2 = group["betas"]
        state["step"] += 1
        t = float(state["step"])
        state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
        denom = (state["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1 ** t))
