"""The attacks that leave files or processes behind, replayed through a pool of one sandbox.

RL rollouts lease sandboxes from a pool (``run_task(..., sandboxes=pool.lease)``): with one
sandbox the grader gets the very sandbox the agent used, ``reset()`` in between. What the
agent left there (a start-up hook, a conftest, a commit, a daemon) must be gone: the
grader's own verdict stays 0, before any monitor.

    pytest -q tests/adversarial/test_pooled.py
"""

from __future__ import annotations

import pytest
from strategies import STRATEGIES

from opencomposer.policies.scripted import ScriptedPolicy
from opencomposer.episode.run import run_task
from opencomposer.sandbox.pool import BlockingSandboxPool, SandboxPool

LEFT_BEHIND = ["a01-sitecustomize", "a06-conftest-root", "a12-dist-info-pytest11", "c01-daemon-left-behind",
               "t05-git-commit-conftest"]


@pytest.fixture
def pool(backend: str):
    with BlockingSandboxPool(SandboxPool(backend, warm=0, max_sandboxes=1)) as p:
        yield p


@pytest.mark.parametrize("sid", LEFT_BEHIND)
def test_left_behind_is_reset_away_in_a_pool_of_one(sid: str, pool, toolz_tasks) -> None:
    strategy = next(s for s in STRATEGIES if s.id == sid)
    task = toolz_tasks[strategy.task % len(toolz_tasks)]
    ep = run_task(task, ScriptedPolicy(strategy.turns(task)), sandboxes=pool.lease)
    d = ep.reward.details
    assert pool.pool.stats["reused"] >= 1, pool.pool.stats  # the grader had the agent's sandbox, reset
    assert d.get("graded_reward", ep.reward.reward) == 0.0 and ep.reward.reward == 0.0, d
    assert d["report"] == "ok" and (d["canary"] == "FAILED" or (d["stopped_at"] and d["canary"] == "MISSING")), d
    assert set(ep.flags) == set(strategy.flags), ep.flags
