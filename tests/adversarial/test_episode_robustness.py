"""An agent cannot crash the grading of its own episode: what it leaves in the workspace is
refused or scored 0, never an exception out of ``run_task`` (an RL rollout would lose the
episode, or its worker).

    pytest -q tests/adversarial/test_episode_robustness.py
"""

from __future__ import annotations

from opencomposer.policies.scripted import ScriptedPolicy, tool_call
from opencomposer.episode.run import run_task


def test_oversized_sparse_file_is_refused_not_a_crash(backend: str, toolz_tasks) -> None:
    """A 1.9 GB sparse file (under the file-size limit) at an allowed path once killed the exec
    server as ``collect`` read it, and the OSError left ``run_task``."""
    task = toolz_tasks[2]
    turns = [[tool_call("run", command="truncate -s 1900M toolz/utils.py && ls -ls toolz/utils.py")],
             [tool_call("submit", message="done")]]
    ep = run_task(task, ScriptedPolicy(turns), backend)
    assert ep.reward.reward == 0.0
    assert "toolz/utils.py" in ep.reward.details["carried"]["refused"]
