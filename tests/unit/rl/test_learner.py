"""The actor/learner boundary of an RL run: the learner takes a ``TrainBatch`` and gives back
``Weights``; nothing else crosses (``rl/run.py``). tiny-random, real samples, one process.

Run: ``pytest tests/unit/rl/test_learner.py``.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from testkit.train_data import rollout_samples

from opencomposer.rl.actor import Batch
from opencomposer.rl.config import RLRunConfig
from opencomposer.rl.learner import Learner, TrainBatch, Weights
from opencomposer.train import distributed

SRC = Path(__file__).resolve().parents[3] / "src" / "opencomposer"


def learner(tmp: Path, kl: float = 0.0, steps: int = 2, save_every: int = 1) -> Learner:
    cfg = RLRunConfig(tasks={"dir": str(tmp / "tasks")}, model={"name": "tiny-random"},
                      loss={"kl_coef": kl}, train={"lr": 1e-3, "bf16": False},
                      rollout={"temperature": 1.0}, run={"steps": steps, "save_every": save_every})
    return Learner(cfg, tmp, "tiny-random", distributed.SINGLE, "cpu")


def test_an_update_on_a_batch_gives_weights_of_the_next_version(tmp_path: Path):
    ln = learner(tmp_path)
    samples = rollout_samples(*ln.trainer.policy_pair(), n=2)
    before = ln.weights()
    assert isinstance(before, Weights) and before.version == 0
    start = {k: v.clone() for k, v in before.state.items()}
    metrics = ln.update(TrainBatch(samples, pairs=[], rollouts=2))
    assert metrics["samples"] == 2 and metrics["staleness_max"] == 0 and metrics["skipped"] == 0.0
    after = ln.weights()
    assert after.version == ln.version == 1
    assert set(after.state) == set(start) and any(not torch.equal(after.state[k], start[k]) for k in start)
    # one process: the actor's 'hf' rollouts sample with the trainer's own model
    assert after.model is not None and after.model[0] is ln.trainer.model


def test_a_batch_of_equal_rewards_without_kl_is_skipped(tmp_path: Path):
    ln = learner(tmp_path)
    samples = rollout_samples(*ln.trainer.policy_pair(), n=2)
    for s in samples:
        s.advantage = 0.0
    metrics = ln.update(TrainBatch(samples, pairs=[], rollouts=2))
    assert metrics["skipped"] == 1.0 and metrics["samples"] == 0 and ln.weights().version == 0


def test_a_checkpoint_keeps_the_actors_state_and_resumes_at_its_step(tmp_path: Path):
    ln = learner(tmp_path, steps=3)
    ln.update(TrainBatch(rollout_samples(*ln.trainer.policy_pair(), n=2), pairs=[], rollouts=2))
    assert ln.resume() == (0, {})  # nothing saved yet
    ln.save(1, {"sampler": {"used": ["a"]}, "row": {"step": 1}})
    again = learner(tmp_path, steps=3)
    step, state = again.resume()
    assert step == again.start_step == 1 and again.version == 1
    assert state["sampler"] == {"used": ["a"]} and state["row"] == {"step": 1}
    mine, theirs = ln.weights().state, again.weights().state
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_checkpoint_is_written_every_save_every_steps_and_at_the_last(tmp_path: Path):
    ln = learner(tmp_path, steps=3, save_every=2)
    for step in (1, 2, 3):
        ln.save(step, None)  # None: a rank other than 0, whose actor state is not written
    assert sorted(p.name for p in ln.ckpt_dir.iterdir() if p.is_dir()) == ["step-0002", "step-0003"]
    assert learner(tmp_path, steps=3).resume() == (3, {"step": 3})


def test_the_learner_sees_only_a_train_batch_of_the_actors_batch(tmp_path: Path):
    """What crosses: Batch.train (samples, pairs, rollout count) in, Weights out."""
    params = list(inspect.signature(Learner.update).parameters)
    assert params == ["self", "batch"]
    assert inspect.signature(Learner.update).parameters["batch"].annotation in ("TrainBatch", TrainBatch)
    assert inspect.signature(Learner.weights).return_annotation in ("Weights", Weights)
    batch = Batch(paths=[], task_ids=["t"], rollouts=[object()] * 3, samples=["s"], pairs=[("a", "b")],
                  points=[], shaping={}, oldest=0)
    assert batch.train == TrainBatch(["s"], [("a", "b")], 3)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("side, forbidden", [
    ("learner", ("opencomposer.rl.actor", "opencomposer.episode", "opencomposer.policies", "opencomposer.sandbox",
                 "opencomposer.inference", "opencomposer.sync", "opencomposer.rl.sampler")),
    ("actor", ("opencomposer.train.trainer", "opencomposer.train.checkpoint", "opencomposer.train.loss",
               "opencomposer.train.distributed")),
])
def test_actor_and_learner_do_not_reach_into_each_other(side: str, forbidden: tuple[str, ...]):
    imported = _imports(SRC / "rl" / f"{side}.py")
    assert not [m for m in imported if m.startswith(forbidden)], imported


def test_no_rank_test_outside_the_distributed_module():
    """Which rank does what is decided in train/distributed.py (on_main, main_only, shows_progress)."""
    train = [SRC / "train" / f for f in ("trainer.py", "sft.py", "pretrain.py", "checkpoint.py", "sharded_checkpoint.py")]
    for path in [SRC / "rl" / f for f in ("run.py", "actor.py", "learner.py")] + train:
        tree = ast.parse(path.read_text())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not names & {"rank", "main", "local_rank"}, (path.name, names & {"rank", "main", "local_rank"})
