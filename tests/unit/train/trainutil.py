"""Helpers for the trainer tests: real sampled rollouts and parameter snapshots.

Rollouts are single short turns (no tools), sampled by ``ModelPolicy`` from the very
model being trained, so their sampler logprobs are on-policy for a fresh trainer.
"""

from __future__ import annotations

from typing import Any

import torch

from opencomposer.harness.trajectory import Step, Trajectory
from opencomposer.policies.model import ModelPolicy
from opencomposer.protocols import Message
from opencomposer.train.samples import Sample, trajectory_samples


def rollout_samples(model: Any, tok: Any, n: int = 4, seed: int = 0, temperature: float = 1.0,
                    max_new_tokens: int = 16, version: int = 0) -> list[Sample]:
    """``n`` one-turn trajectories sampled from ``model``; advantages alternate +1 / -1."""
    policy = ModelPolicy((model, tok), temperature=temperature, max_new_tokens=max_new_tokens,
                         seed=seed, policy_version=version)
    samples = []
    for i in range(n):
        messages = [Message("system", "You are terse."), Message("user", f"Name a number, #{seed}-{i}.")]
        out = policy.act(messages, [])
        step = Step(0, out.text, prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                    token_ids=out.token_ids, logprobs=out.logprobs, policy_version=out.policy_version)
        traj = Trajectory(messages + [Message("assistant", out.text)], steps=[step], task_id=f"t{i}")
        samples += trajectory_samples(traj, tok, [], advantage=1.0 if i % 2 == 0 else -1.0)
    return samples


def params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
