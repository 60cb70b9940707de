"""The oracle on many tasks: each through the harness and the hidden-test reward, one row per task.

    rows = run_oracle(tasks, "namespace", workers=2)   # [{"task", "reward", "seconds", "exit"}, ...]
    task_stats(["tasks/"], oracle="namespace", run_oracle=run_oracle)   # its solve rate

``tasks stats --oracle`` counts these rows (``tasks/stats.py``, which sits below the episode and
so is handed this function). A crash is an unsolved task, its row says why.

Test: ``pytest tests/unit/tasks/sources/test_stats.py``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from opencomposer.episode.run import run_task
from opencomposer.policies import make_policy
from opencomposer.tasks.format import Task


def run_oracle(tasks: list[Task], backend: str, workers: int = 2) -> list[dict]:
    """The oracle policy on each task through the harness + hidden-test reward."""

    def one(task: Task) -> dict:
        try:
            r = run_task(task, make_policy("oracle", task=task), backend)
            return {"task": task.id, "reward": r.reward.reward, "seconds": r.seconds["total"],
                    "exit": r.trajectory.exit_reason}
        except Exception as e:  # noqa: BLE001 -- a crash is an unsolved task, reported with its reason
            return {"task": task.id, "reward": 0.0, "seconds": 0.0, "exit": f"crash: {type(e).__name__}: {e}"}

    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(one, tasks))
