"""Two built-in rollout engines in a tiny RL run (``[rollout] engines = 2``), end to end on real
toolz tasks in real sandboxes: both engines serve, each group on one, the weights reach both;
an engine whose step dies mid-run voids its episodes, the step completes on the other, and a
fresh engine takes its place at the next weight sync.

Run: ``pytest tests/integration/test_rl_engines.py`` (a few minutes on 2 cores; needs PyPI once
for the toolz tasks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.rl_tasks import write_cfg

from opencomposer.config import load_config
from opencomposer.inference.engine.core import Engine
from opencomposer.pipeline.run import run_pipeline
from opencomposer.rl.config import RLRunConfig


def _two_engines(tmp_path: Path, tasks: Path, out: Path) -> RLRunConfig:
    """Two steps of two groups (k = 2) on two built-in engines; all four tasks trained on, none held out."""
    text = write_cfg(tmp_path, tasks, out, steps=2, kl=0.05, engine="builtin").read_text()
    text = text.replace("heldout = 1", "heldout = 0").replace("tasks_per_step = 1", "tasks_per_step = 2\nengines = 2")
    p = tmp_path / "engines.toml"
    p.write_text(text)
    return load_config(p, RLRunConfig)


def _failures(monkeypatch) -> dict[int, list[str]]:
    """The errors of each step's failed rollouts, as the actor collects them (a spy: the rollouts run as ever)."""
    from opencomposer.rl.actor import Actor

    errors: dict[int, list[str]] = {}
    roll = Actor._roll

    def spy(self, paths):
        ids, rollouts = roll(self, paths)
        errors[len(errors) + 1] = [r.error for r in rollouts if r.failed]
        return ids, rollouts

    monkeypatch.setattr(Actor, "_roll", spy)
    return errors


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_builtin_engines_serve_one_run_each_group_on_one_and_both_follow_the_weights(toolz_tasks, tmp_path,
                                                                                         monkeypatch):
    out = tmp_path / "run"
    errors = _failures(monkeypatch)
    run_pipeline(_two_engines(tmp_path, toolz_tasks, out), log=lambda m: None)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2] and all(r["train_tokens"] > 0 for r in rows)
    for r in rows:
        # one group (k = 2 episodes) on each engine, none split, both engines generating
        assert r["engine_episodes_0"] == r["engine_episodes_1"] == 2, r
        assert r["engine_requests_0"] > 0 and r["engine_requests_1"] > 0
        assert r["engine_groups_split"] == 0 and r["engines_up"] == 2 and r["failed_rollouts"] == 0, errors
        assert r["engine_failures_0"] == r["engine_failures_1"] == 0
    # step 2 sampled after the sync: both engines ran the learner's weights of step 1, and so
    # every token trained on in step 2 is of that version
    assert rows[0]["engine_version_0"] == rows[0]["engine_version_1"] == 0
    assert rows[1]["engine_version_0"] == rows[1]["engine_version_1"] == rows[0]["policy_version"] == 1
    assert rows[1]["staleness_max"] == 0


def test_an_engine_that_dies_mid_step_voids_its_episodes_and_is_rebuilt(toolz_tasks, tmp_path, monkeypatch):
    engines: list[Engine] = []
    real_init, real_step = Engine.__init__, Engine.step

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        engines.append(self)

    def step(self):  # the second engine built (engine 1) dies at its first step; every other step is real
        if len(engines) > 1 and self is engines[1] and not died:
            died.append(self)
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return real_step(self)

    died: list[Engine] = []
    monkeypatch.setattr(Engine, "__init__", init)
    monkeypatch.setattr(Engine, "step", step)
    errors = _failures(monkeypatch)
    out = tmp_path / "run"
    with pytest.warns(RuntimeWarning, match=r"rollout engine 1 \(cpu\) failed: RuntimeError: CUDA error"):
        run_pipeline(_two_engines(tmp_path, toolz_tasks, out), log=lambda m: None)
    first, second = _rows(out)
    # step 1: engine 1's episodes in that step are failed rollouts (no samples); the step trained on the rest
    assert first["engine_failures_1"] == 1 and first["engines_up"] == 1
    assert 1 <= first["failed_rollouts"] <= 2 and first["train_tokens"] > 0, errors
    assert all("engine 1 (cpu) failed" in e for e in errors[1]), errors
    # step 2: a fresh engine 1, built on the weights of the sync (version 1), serves its group
    assert len(engines) == 3 and died == [engines[1]]
    assert second["engines_up"] == 2 and second["engine_failures_1"] == 0 and second["failed_rollouts"] == 0, errors
    assert second["engine_episodes_0"] == second["engine_episodes_1"] == 2
    assert second["engine_version_0"] == second["engine_version_1"] == 1 and second["staleness_max"] == 0
