"""The trainer asks the factory for harder tasks as its pass rate rises: ``[tasks] factory`` +
``harder_every`` in an RL config, the real factory on a fixture library, a pass-rate sequence
that crosses ``raise_at``; the new tasks join the sampler's pool at the higher level."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_factory import CORE, TESTS, UTIL
from testkit.dists import make_sdist

from opencomposer.config import ConfigError, validate
from opencomposer.rl.config import TasksSection
from opencomposer.rl.sampler import TaskSampler
from opencomposer.rl.taskpool import HarderTasks
from opencomposer.tasks.format import Task


def test_harder_every_needs_a_factory() -> None:
    with pytest.raises(ConfigError, match="harder_every needs tasks.factory"):
        validate({"dir": "t", "harder_every": 2}, TasksSection, "run.toml")


@pytest.mark.slow  # one small venv, two factory batches
def test_rising_pass_rate_brings_harder_tasks(tmp_path: Path) -> None:
    sdist = make_sdist(tmp_path, "minilib", {
        "minilib/__init__.py": "", "minilib/core.py": CORE, "minilib/util.py": UTIL,
        "tests/test_core.py": TESTS.format(counter=str(tmp_path / "flaky-count"))})
    fcfg = tmp_path / "factory.toml"
    # starts at "block" only; one move up (step 4) reaches "feature" only
    fcfg.write_text('[factory]\nmax_per_library = 2\nworkers = 1\ntest_timeout = 120\n'
                    '[difficulty]\nposition = 1.0\nwidth = 0.5\nfloor = 0.0\nstep = 4.0\n'
                    'raise_at = 0.7\nlower_at = 0.1\n'
                    f'[[libraries]]\nspec = "{sdist}"\n')
    cfg = validate({"dir": str(tmp_path / "tasks"), "factory": str(fcfg), "harder_every": 2,
                    "pass_window": 2}, TasksSection, "run.toml")
    logs: list[str] = []
    harder = HarderTasks(cfg, tmp_path / "run", log=logs.append)
    first = harder.factory.make()  # the run's starting pool, made at the initial level
    pool = harder.made_tasks()
    assert first.summary()["levels"] == {"block": len(pool)} and pool
    sampler = TaskSampler(pool, 1, seed=0)

    # a weak start: no report on odd steps, a rolling 0.35 at step 2 moves nothing
    assert harder.after_step(1, 0.2, sampler)["tasks_added"] == 0
    row = harder.after_step(2, 0.5, sampler)
    assert row == {"tasks_level_position": 1.0, "tasks_added": 0.0} and sampler.remaining == len(pool)
    # the policy improves: step 3 is not a reporting step, step 4's rolling 0.9 >= raise_at
    assert harder.after_step(3, 0.8, sampler)["tasks_added"] == 0
    row = harder.after_step(4, 1.0, sampler)
    assert row["tasks_level_position"] == 5.0 and row["tasks_added"] >= 1, (row, logs)
    new = [p for p in harder.made_tasks() if p not in pool]
    assert len(new) == row["tasks_added"] and sampler.remaining == len(pool) + len(new)
    assert {Task.load(p).meta.feature.level for p in new} == {"feature"}
    assert any("task levels 1.0 -> 5.0" in m for m in logs)
    # the sampler hands the new tasks out once the old ones are used
    handed = [sampler.next_batch()[0].name for _ in range(sampler.remaining)]
    assert set(handed) == {p.name for p in pool + new}

    # a resumed run restores the schedule and sees every task the factory made
    again = HarderTasks(cfg, tmp_path / "run", log=logs.append)
    again.restore(harder.state())
    assert again.factory.schedule.position == 5.0 and again.made_tasks() == harder.made_tasks()
