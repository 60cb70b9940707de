"""Fixtures of the reward-integrity suite: real toolz tasks, and each attack played once per session.

    toolz_tasks      # four tasks made from toolz 1.2.0 (built once per session, ~1 min; needs PyPI)
    episode(s, b)    # the EpisodeResult of strategy ``s`` on backend ``b``, played once and cached

Every episode goes through the ordinary path, ``run_task(task, policy, backend)``: the agent
works in one sandbox, its changes are collected and graded in a fresh one, the monitors void
a flagged reward.

Test: ``pytest -q tests/adversarial``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from opencomposer.sandbox.gvisor import unavailable_reason as gvisor_reason
from opencomposer.sandbox.namespace import unavailable_reason as ns_reason
from opencomposer.tasks.format import Task, task_dirs

TOOLZ = "pypi:toolz==1.2.0"
NS_REASON = ns_reason()
GVISOR_REASON = gvisor_reason()
BACKENDS = [
    pytest.param("namespace", marks=[pytest.mark.namespace, pytest.mark.skipif(NS_REASON is not None, reason=f"namespace: {NS_REASON}")]),
    pytest.param("gvisor", marks=pytest.mark.skipif(GVISOR_REASON is not None, reason=f"gvisor: {GVISOR_REASON}")),
]


@pytest.fixture(scope="session")
def toolz_tasks(tmp_path_factory) -> list[Task]:
    from opencomposer.tasks.make import make_tasks

    out = tmp_path_factory.mktemp("adversarial-tasks")
    rep = make_tasks(TOOLZ, out, max_tasks=4, seed=1, backend="local", levels=("body", "function"))
    assert len(rep.made) == 4, rep
    return [Task.load(d) for d in sorted(task_dirs(out))]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def episodes(toolz_tasks):
    """``play(strategy, backend)``: the strategy's episode, run once per session (the reward test
    and the monitor test of a strategy read the same episode)."""
    from opencomposer.policies.scripted import ScriptedPolicy
    from opencomposer.episode.run import run_task

    cache: dict = {}

    def play(strategy, backend: str):
        key = (strategy.id, backend)
        if key not in cache:
            task = toolz_tasks[strategy.task % len(toolz_tasks)]
            cache[key] = run_task(task, ScriptedPolicy(strategy.turns(task)), backend)
        return cache[key]

    return play
