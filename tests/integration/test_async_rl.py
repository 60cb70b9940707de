"""Rollouts ahead of the trainer (``[rollout] max_staleness``): tiny-random on real toolz tasks,
the built-in engine taking each update in flight, real local sandboxes.

Run: ``pytest tests/integration/test_async_rl.py`` (about a minute on 2 cores; the toolz
tasks of ``conftest.py``: 3 for training, 1 held out).
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch

from opencomposer.config import load_config
from opencomposer.rl.async_rollouts import RolloutThreadError
from opencomposer.rl.config import RLRunConfig
from opencomposer.rl.run import RLRun
from opencomposer.rl.sampler import PoolExhausted
from opencomposer.rl.taskpool import ensure_tasks, split_tasks
from opencomposer.train.checkpoint import load_checkpoint

from conftest import following_server
from testkit.rl_tasks import write_cfg


def async_run(tmp: Path, tasks: Path, out: Path, steps: int, resume: bool = False, on_step=None,
              turn_tokens: int = 384, train: str = "") -> RLRun:
    """An RLRun one batch ahead. One model turn of 384 tokens (a random model rarely stops),
    the K = 2 episodes' turns decoded one after the other (max_batch = 1) with top-p sampling
    (a sort of the vocabulary per token: 3-4x a plain decode step of tiny-random on this CPU,
    while the trainer's cost does not change): decoding a batch takes about twice an update
    on it, so an update lands mid-turn, between two decode steps."""
    text = write_cfg(tmp, tasks, out, steps=steps, kl=0.05, engine="builtin").read_text()
    text = text.replace("max_new_tokens = 12", f"max_new_tokens = {turn_tokens}\nmax_staleness = 1\nmax_batch = 1\ntop_p = 0.95")
    text = text.replace("max_turns = 2", "max_turns = 1").replace("[train]\n", f"[train]\n{train}")
    p = tmp / f"async-{steps}.toml"
    p.write_text(text)
    cfg = load_config(p, RLRunConfig)
    train, _ = split_tasks(ensure_tasks(cfg.tasks, "local"), cfg.tasks.heldout, cfg.tasks.seed, out)
    return RLRun(cfg, train, out, resume=resume, on_step=on_step)


def rows_of(out: Path) -> list[dict]:
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def rollout_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("rollouts-ahead", "rollout_"))]


def test_rollouts_run_ahead_with_updates_in_flight(toolz_tasks: Path, tmp_path: Path):
    """Three steps one batch ahead, then the pool runs out in the rollout thread (a fourth step
    of a 3-task pool) and the trainer hears of it with the thread's traceback."""
    from opencomposer.models.registry import load_model

    out = tmp_path / "ahead"
    run = async_run(tmp_path, toolz_tasks, out, steps=4)
    start = torch.nn.utils.parameters_to_vector(run.learner.trainer.model.parameters()).detach().clone()
    with pytest.raises(RolloutThreadError) as e:
        run.run()
    assert isinstance(e.value.__cause__, PoolExhausted)
    where = "".join(traceback.format_exception(e.value.__cause__))
    assert "collect_batch" in where and "in issue" in where  # the thread's own frames
    assert not rollout_threads(), "the rollout thread and its episode threads stopped"
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["policy_version"] for r in rows] == [1, 2, 3]
    used = [t for r in rows for t in r["task_ids"]]
    assert len(used) == len(set(used)) == 3
    # the first batch came from version 0, the next ones were started a version before their update
    assert rows[0]["staleness_max"] == 0
    assert all(r["staleness_max"] <= 1 and r["dropped_stale"] == 0 for r in rows)
    assert max(r["staleness_max"] for r in rows[1:]) == 1 and max(r["staleness_mean"] for r in rows) > 0
    # an update reached the engine while a rollout ran: its tokens span two versions
    assert max(r["versions_per_rollout_max"] for r in rows) == 2, [r["versions_per_rollout"] for r in rows]
    for r in rows:
        for key in ("time_wait_rollouts", "time_rollout_idle", "time_step", "time_rollout", "time_train",
                    "time_update", "time_weights", "time_publish", "time_train_cpu"):
            assert r[key] >= 0, key
        # the trainer's parts lie inside its time (each rounded to 10 ms), and its thread ran for some of it
        assert r["time_update"] + r["time_weights"] <= r["time_train"] + 0.02
        assert 0 < r["time_train_cpu"] <= r["time_update"] + r["time_weights"] + 0.02
    trained = torch.nn.utils.parameters_to_vector(run.learner.trainer.model.parameters())
    assert not torch.equal(start, trained)
    base, tok = load_model("tiny-random")
    from opencomposer.train.trainer import Trainer
    t = Trainer(base, tok, run.cfg.train)
    assert load_checkpoint(out / "checkpoints", t)["step"] == 3
    assert torch.equal(torch.nn.utils.parameters_to_vector(t.model.parameters()), trained)


def test_lora_ahead_of_the_trainer_reaches_the_engine_merged_in_flight(toolz_tasks: Path, tmp_path: Path):
    """LoRA with rollouts one batch ahead: each update's merged weights (base + adapters' product)
    reach the built-in engine between two decode steps of a running rollout."""
    from opencomposer.models.registry import load_model
    from opencomposer.train.trainer import merged_lora_state

    out = tmp_path / "lora-ahead"
    run = async_run(tmp_path, toolz_tasks, out, steps=3, train="lora = true\nlora_r = 4\n")
    run.run()
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["policy_version"] for r in rows] == [1, 2, 3]
    assert all(r["staleness_max"] <= 1 and r["dropped_stale"] == 0 and r["train_tokens"] > 0 for r in rows)
    assert max(r["staleness_max"] for r in rows[1:]) == 1
    assert max(r["versions_per_rollout_max"] for r in rows) == 2, [r["versions_per_rollout"] for r in rows]
    # the last update reached the engine too (publish, while rollouts ran ahead): it holds the
    # trainer's merged weights of version 3, which differ from the base model's
    engine = run.actor.policy.policy.engine
    assert engine.policy_version == run.learner.trainer.version == 3
    merged = merged_lora_state(run.learner.trainer.model)
    views = engine.weight_views({k: v.shape for k, v in merged.items()})
    differ = [k for k in views if not torch.equal(views[k].float().cpu(), merged[k].float().cpu())]
    assert differ == [], differ[:3]
    base = load_model("tiny-random")[0].state_dict()
    assert any(not torch.equal(merged[k].float(), base[k].float()) for k in merged if k in base)


def test_a_stop_with_a_batch_in_flight_hands_its_tasks_out_again(toolz_tasks: Path, tmp_path: Path):
    """Ctrl-C after step 1 while batch 2 is being collected: the thread stops, the checkpoint
    counts only the task trained, and --resume collects the one that was in flight."""
    out = tmp_path / "stopped"

    def stop(row: dict) -> None:
        raise KeyboardInterrupt

    run = async_run(tmp_path, toolz_tasks, out, steps=2, on_step=stop, turn_tokens=128)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run.run()
    assert time.monotonic() - t0 < 300 and not rollout_threads()
    in_flight = list(run.actor.sampler.in_flight)
    assert len(in_flight) == 1, "batch 2 was handed out when the trainer took batch 1"
    state = json.loads((out / "checkpoints" / "step-0001" / "state.json").read_text())
    assert len(state["sampler"]["used"]) == 1 and in_flight[0] not in state["sampler"]["used"]

    resumed = async_run(tmp_path, toolz_tasks, out, steps=2, resume=True, turn_tokens=128)
    assert resumed.start_step == 1
    resumed.run()
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [1, 2]
    used = [t for r in rows for t in r["task_ids"]]
    assert len(used) == len(set(used)) == 2  # no task trained twice
    state = json.loads((out / "checkpoints" / "step-0002" / "state.json").read_text())
    assert state["sampler"]["used"][-1] == in_flight[0]  # the task in flight at the stop, trained now


def test_rollouts_ahead_on_a_server_that_follows_the_store(toolz_tasks: Path, tmp_path: Path):
    """engine = "server": each update is published and the run goes on without waiting for the
    server; the staleness check holds on the versions the server reports per token."""
    store, out = tmp_path / "weights", tmp_path / "server-ahead"
    with following_server(store) as (front, url):
        text = write_cfg(tmp_path, toolz_tasks, out, steps=2, kl=0.05, engine="server", sync=store,
                         base_url=url).read_text().replace("max_new_tokens = 12", "max_new_tokens = 12\nmax_staleness = 1")
        p = tmp_path / "server-ahead.toml"
        p.write_text(text)
        cfg = load_config(p, RLRunConfig)
        train, _ = split_tasks(ensure_tasks(cfg.tasks, "local"), cfg.tasks.heldout, cfg.tasks.seed, out)
        run = RLRun(cfg, train, out)
        run.run()
        run.actor.policy.close()
        rows = rows_of(out)
        assert [r["step"] for r in rows] == [1, 2] and [r["policy_version"] for r in rows] == [1, 2]
        assert all(r["staleness_max"] <= 1 and r["train_tokens"] > 0 for r in rows)
        used = [t for r in rows for t in r["task_ids"]]
        assert len(used) == len(set(used)) == 2
        engine = front.arms["a"].loop.engine
        deadline = time.monotonic() + 30
        while engine.policy_version != 2 and time.monotonic() < deadline:  # published, not waited for
            time.sleep(0.05)
        assert engine.policy_version == 2
