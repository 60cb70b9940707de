"""An episode can take its sandbox from a pool: the pool's reset gives the next episode a clean workspace."""

from __future__ import annotations

from opencomposer.policies.oracle import OraclePolicy
from opencomposer.episode.run import run_task
from opencomposer.sandbox.pool import BlockingSandboxPool, SandboxPool
from opencomposer.tasks.deletion import make_patch

from testkit.oracle_tasks import STATS, STATS_DELETED, make_task


def test_two_episodes_share_one_pooled_sandbox(tmp_path, cfg):
    task = make_task(tmp_path / "task", {"mathy/__init__.py": "", "mathy/stats.py": STATS},
                     {"mathy/stats.py": STATS_DELETED}, make_patch(STATS, STATS_DELETED, "mathy/stats.py"),
                     "mathy.stats.mean")
    pool = BlockingSandboxPool(SandboxPool("local", warm=1, max_sandboxes=1))
    try:
        results = [run_task(task, OraclePolicy(task), "local", cfg, sandboxes=pool.lease) for _ in range(2)]
    finally:
        pool.close()
    for r in results:  # the second episode found the deleted body again: the pool reset the workspace
        edits = [e for s in r.trajectory.steps for e in s.tool_events if e.name == "edit_file"]
        assert r.trajectory.exit_reason == "submitted" and edits and all(e.ok for e in edits)
