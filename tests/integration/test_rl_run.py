"""Two RL steps of tiny-random on real tasks in real sandboxes, checkpoint reload, resume.

Run: ``pytest tests/integration/test_rl_run.py`` (a few minutes on 2 cores; needs PyPI once
for the toolz tasks).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import following_server
from testkit.rl_tasks import write_cfg

from opencomposer.config import load_config
from opencomposer.harness.trajectory import Trajectory
from opencomposer.pipeline.run import run_pipeline
from opencomposer.rl.config import RLRunConfig
from opencomposer.train.checkpoint import load_checkpoint, resolve_checkpoint
from opencomposer.train.trainer import Trainer


def _follower_matches(store: Path, trainer: Trainer, version: int, follower=None):
    """An engine following the run's weight store ([sync]) holds the trainer's weights;
    returns (engine, subscriber) to poll again later."""
    from opencomposer.inference.engine.core import Engine
    from opencomposer.models.registry import load_model
    from opencomposer.sync.store import FileStore
    from opencomposer.sync.subscriber import WeightSubscriber

    engine, sub = follower or (Engine(load_model("tiny-random")[0], None, max_model_len=64),
                               WeightSubscriber(FileStore(store)))
    sub.poll(engine)
    assert engine.policy_version == version
    sd = trainer.model.state_dict()
    for name, view in engine.weight_views({k: v.shape for k, v in sd.items()}).items():
        assert torch.equal(view, sd[name]), name
    return engine, sub


def test_rollouts_on_a_server_that_follows_the_runs_weight_store(toolz_tasks: Path, tmp_path: Path):
    """rollout.engine = "server": the trainer publishes each version to the store, an
    `opencomposer serve --weights-from` (here in a thread) applies it, and the run waits for
    the server to run its version before each step's rollouts; samples carry the server's
    exact token ids and logprobs."""
    store, out = tmp_path / "weights", tmp_path / "run"
    with following_server(store) as (front, url):
        cfg = load_config(write_cfg(tmp_path, toolz_tasks, out, steps=2, kl=0.05, engine="server", sync=store,
                                    base_url=url), RLRunConfig)
        run_pipeline(cfg, log=lambda m: None)
        rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and all(r["train_tokens"] > 0 for r in rows)
        engine = front.arms["a"].loop.engine
        assert engine.policy_version == rows[-1]["policy_version"] == 2
        from opencomposer.models.registry import load_model
        trainer = Trainer(*load_model("tiny-random"), cfg.train)
        load_checkpoint(out / "checkpoints", trainer)
        sd = trainer.model.state_dict()
        for name, view in engine.weight_views({k: v.shape for k, v in sd.items()}).items():
            assert torch.equal(view, sd[name]), name


def _keep_all(cfg: Path) -> Path:
    """The config with [rollout] keep_transcripts = "all"."""
    cfg.write_text(cfg.read_text().replace("[rollout]\n", '[rollout]\nkeep_transcripts = "all"\n', 1))
    return cfg


def test_two_steps_then_resume(toolz_tasks: Path, tmp_path: Path):
    from opencomposer.models.registry import load_model
    out, store = tmp_path / "run", tmp_path / "weights"
    cfg = load_config(_keep_all(write_cfg(tmp_path, toolz_tasks, out, steps=2, kl=0.05, sync=store)), RLRunConfig)
    result = run_pipeline(cfg, log=lambda m: None)
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # [rollout] keep_transcripts = "all": each step's k rollouts, readable transcripts
    assert [r["transcripts_kept"] for r in rows] == [2, 2]
    for step in (1, 2):
        kept = sorted((out / "transcripts" / f"step-{step:04d}").glob("*.json"))
        assert len(kept) == 2 and all(Trajectory.load(p).meta["rl"]["step"] == step for p in kept)
    for r in rows:
        for key in ("reward_mean", "pass@1", "pass@2", "mean_completion_tokens", "tool_calls", "invalid_calls",
                    "kl", "loss", "entropy", "grad_norm", "time_rollout", "time_train"):
            assert key in r, key
    assert (out / "report.png").stat().st_size > 10_000 and (out / "report.md").exists()
    assert list((out / "tb").glob("events.out.tfevents*")), "metrics also go to TensorBoard"
    assert set(result["evals"]) == {"base", "rl"}
    # the checkpoint reloads, and its parameters differ from the initial model's (the k1 KL
    # term has a gradient even when a group's rewards are all equal and advantages are 0)
    assert resolve_checkpoint(out / "checkpoints").name.endswith("2")
    base, tok = load_model("tiny-random")
    start = torch.nn.utils.parameters_to_vector(base.parameters()).clone()
    trainer = Trainer(base, tok, cfg.train)
    assert load_checkpoint(out / "checkpoints", trainer)["step"] == 2
    trained = torch.nn.utils.parameters_to_vector(trainer.model.parameters())
    assert not torch.equal(start, trained)
    # [sync]: each version went to the store (a full snapshot first, then deltas), and an
    # engine following it holds the checkpoint's weights
    assert [r["sync_kind_full"] for r in rows] == [0.0, 0.0] and all(r["sync_stored_mb"] > 0 for r in rows)
    follower = _follower_matches(store, trainer, rows[-1]["policy_version"])
    # resume: step 3 continues from the checkpoint with a task never used before
    cfg3 = load_config(_keep_all(write_cfg(tmp_path, toolz_tasks, out, steps=3, kl=0.05, sync=store)), RLRunConfig)
    stale = out / "transcripts" / "step-0003" / "killed-before-its-checkpoint.json"
    stale.parent.mkdir()
    stale.write_text("{}")  # as a step killed after its transcripts and before its checkpoint leaves them
    run_pipeline(cfg3, resume=True, log=lambda m: None)
    assert not stale.exists() and len(list(stale.parent.glob("*.json"))) == 2  # step 3 done again, kept once
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    trainer3 = Trainer(load_model("tiny-random")[0], tok, cfg.train)
    load_checkpoint(out / "checkpoints", trainer3)
    _follower_matches(store, trainer3, rows[-1]["policy_version"], follower)  # the resumed run's timeline
    used = [t for r in rows for t in r["task_ids"]]
    assert len(used) == len(set(used)) == 3
    held = json.loads((out / "split.json").read_text())["heldout"]
    assert not set(used) & set(held)
    state = json.loads((resolve_checkpoint(out / "checkpoints") / "state.json").read_text())
    assert state["step"] == 3 and len(state["sampler"]["used"]) == 3


def test_equal_rewards_and_no_kl_leave_weights_unchanged(toolz_tasks: Path, tmp_path: Path):
    """All-zero rewards give zero advantages: with kl_coef = 0 nothing moves (no noise amplified)."""
    from opencomposer.models.registry import load_model
    out = tmp_path / "run0"
    cfg = load_config(write_cfg(tmp_path, toolz_tasks, out, steps=1, kl=0.0), RLRunConfig)
    run_pipeline(cfg, log=lambda m: None)
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward_mean"] == 0.0 and row["grad_norm"] == 0.0
    base, tok = load_model("tiny-random")
    start = torch.nn.utils.parameters_to_vector(base.parameters()).clone()
    trainer = Trainer(base, tok, cfg.train)
    load_checkpoint(out / "checkpoints", trainer)
    assert torch.equal(start, torch.nn.utils.parameters_to_vector(trainer.model.parameters()))


def test_killed_mid_step_resumes_without_loss(toolz_tasks: Path, tmp_path: Path):
    """SIGKILL during step 2, then --resume: steps 1..3 each recorded once, no task reused."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "killed"
    cfg = write_cfg(tmp_path, toolz_tasks, out, steps=3, kl=0.05)
    cmd = [sys.executable, "-m", "opencomposer.cli", "train", "--config", str(cfg)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 1:
            break
        time.sleep(0.2)
    time.sleep(1.0)  # into step 2
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    r = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "COLUMNS": "80"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "RL step 3: reward " in r.stderr  # an 80-column log gets each step's figures whole, on a line
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    used = [t for row in rows for t in row["task_ids"]]
    assert len(used) == len(set(used)) == 3
    assert json.loads(r.stdout.strip().splitlines()[-1])["steps"] >= 1


def test_sft_warm_start_is_checkpointed_as_step_zero(toolz_tasks: Path, tmp_path: Path):
    """Oracle traces -> SFT -> a step-0 checkpoint with the SFT weights, so a run stopped
    before its first RL checkpoint resumes from SFT, not from the base model."""
    from safetensors.torch import load_file

    out = tmp_path / "sft"
    text = write_cfg(tmp_path, toolz_tasks, out, steps=1, kl=0.0).read_text()
    text = text.replace("max_turns = 2", "max_turns = 4").replace(
        "[sft]\nenabled = false", "[sft]\nenabled = true\nepochs = 1\nmax_traces = 1")
    cfgp = tmp_path / "rl-sft.toml"
    cfgp.write_text(text)
    cfg = load_config(cfgp, RLRunConfig)
    result = run_pipeline(cfg, log=lambda m: None)
    sft = json.loads((out / "sft.json").read_text())
    assert sft["traces"] == 1 and sft["loss_last"] > 0
    assert set(result["evals"]) == {"base", "sft", "rl"}
    step0 = out / "checkpoints" / "step-0000"
    assert step0.is_dir()
    a = load_file(str(next(step0.rglob("*.safetensors"))))
    b = load_file(str(next((out / "sft_model").rglob("*.safetensors"))))
    shared = set(a) & set(b)
    assert shared and all(torch.equal(a[k], b[k]) for k in shared)


def test_shaping_feedback_and_summaries_in_one_step(toolz_tasks: Path, tmp_path: Path):
    """Every issue-7 term switched on, rollouts from the built-in engine: the step logs each
    term, the chain's segments train, and the feedback distillation moves the weights even
    though all test rewards are 0."""
    from opencomposer.models.registry import load_model
    out = tmp_path / "shaped"
    # the inference engine samples
    text = write_cfg(tmp_path, toolz_tasks, out, steps=1, kl=0.0, engine="builtin").read_text()
    text = text.replace("max_turns = 2", "max_turns = 3\nsummarize_at = 1050\nmax_summaries = 1")
    text += """
[reward.length]
enabled = true
apply_to = "all"
[reward.behaviour]
enabled = true
[feedback]
enabled = true
coef = 1.0
"""
    p = tmp_path / "shaped.toml"
    p.write_text(text)
    cfg = load_config(p, RLRunConfig)
    run_pipeline(cfg, log=lambda m: None)
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("r_task", "r_length", "r_invalid_calls", "r_lint", "r_final_message", "r_question", "r_hacking",
                "shaped_reward_mean", "hacking_flagged", "feedback_points", "feedback_no_call"):
        assert key in row, key
    # where the step's time went: the episodes' parts and the built-in engine's own counts
    assert row["episode_s_max"] >= row["episode_s_mean"] > 0 and row["episode_policy_s_mean"] > 0
    assert row["engine_generated_tokens"] > 0 and row["engine_prefill_s"] > 0 and 0 <= row["prefix_hit_fraction"] < 1
    # the stepping thread's wall and CPU seconds in steps reach the row (wall >= CPU: the rest is waiting)
    assert row["engine_step_s"] > 0 and row["engine_step_cpu_s"] > 0 and row["engine_step_runqueue_s"] >= 0
    assert row["reward_mean"] == 0.0 and row["r_length"] > 0  # tiny-random solves nothing, but pays for length
    assert row["feedback_points"] >= 1 and row["distill_kl"] > 0 and not row["update_skipped"]
    base, tok = load_model("tiny-random")
    start = torch.nn.utils.parameters_to_vector(base.parameters()).clone()
    trainer = Trainer(base, tok, cfg.train)
    load_checkpoint(out / "checkpoints", trainer)
    assert not torch.equal(start, torch.nn.utils.parameters_to_vector(trainer.model.parameters()))
    assert row["policy_version"] == 1  # the engine sampled from version 0, the update made 1


def test_a_moe_models_routes_are_replayed_in_training(toolz_tasks: Path, tmp_path: Path):
    """tiny-random-moe sampled by the built-in engine: every training sequence carries the
    experts the engine routed its tokens to, and the trainer's forward pass reuses them (the
    KL term keeps the sequences of a group whose rewards are equal: an untrained model's are)."""
    out = tmp_path / "moe"
    cfg = load_config(write_cfg(tmp_path, toolz_tasks, out, steps=1, kl=0.05, model="tiny-random-moe",
                                engine="builtin"), RLRunConfig)
    run_pipeline(cfg, log=lambda m: None)
    [row] = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["samples"] > 0 and not row["update_skipped"]
    # every token of every trained sequence but its last had its routes recorded
    assert row["replayed_route_tokens"] > 0 and row["replayed_route_tokens"] <= row["train_tokens"]
    assert row["replayed_route_tokens"] >= row["train_tokens"] - row["samples"]
