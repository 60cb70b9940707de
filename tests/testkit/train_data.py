"""Shared fixtures and helpers of the trainer tests (registered in tests/conftest.py), for the
unit tier (tests/unit/train, tests/unit/rl) and the distributed tier (tests/distributed).

    transcripts      # two transcripts of a scripted policy fixing a bug in a real local sandbox
    one_thread       # one intra-op torch thread for the test (tests/unit/train applies it to all)

Helpers: ``rollout_samples`` (real sampled rollouts) and ``params`` / ``grads`` snapshots.
Rollouts are single short turns (no tools), sampled by ``ModelPolicy`` from the very model
being trained, so their sampler logprobs are on-policy for a fresh trainer. Imports are
inside the functions: every test session loads this plugin, most never train.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

    from opencomposer.train.samples import Sample


@pytest.fixture
def one_thread():
    """One intra-op thread: on a small shared machine, OpenMP threads spinning against other
    jobs made these tiny-model steps 10-20x slower (measured: 0.8 s vs 11 s per rollout)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def transcripts(tmp_path: Path) -> list[Path]:
    """Two transcripts of a scripted (token-less, like the oracle) policy in a real sandbox."""
    from opencomposer.harness.loop import Agent
    from opencomposer.policies.scripted import ScriptedPolicy, tool_call
    from opencomposer.protocols import SandboxSpec
    from opencomposer.sandbox import make_sandbox

    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    paths = []
    with make_sandbox(SandboxSpec(base_dir=tmp_path / "repo", env_dir=Path(sys.prefix)), "local") as sb:
        for i in range(2):
            policy = ScriptedPolicy([
                [tool_call("read_file", path="calc.py")],
                [tool_call("edit_file", path="calc.py", old="a - b", new="a + b")],
                [tool_call("submit", message=f"fixed add ({i})")],
            ])
            traj = Agent(sb, policy).run("Fix add in calc.py.", task_id=f"t{i}")
            assert traj.exit_reason == "submitted"
            paths.append(traj.save(tmp_path / "transcripts" / f"t{i}.json"))
    return paths


def rollout_samples(model: Any, tok: Any, n: int = 4, seed: int = 0, temperature: float = 1.0,
                    max_new_tokens: int = 16, version: int = 0) -> list[Sample]:
    """``n`` one-turn trajectories sampled from ``model``; advantages alternate +1 / -1."""
    from opencomposer.harness.trajectory import Step, Trajectory
    from opencomposer.policies.model import ModelPolicy
    from opencomposer.protocols import Message
    from opencomposer.train.samples import trajectory_samples

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
