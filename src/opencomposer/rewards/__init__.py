"""The reward a rollout trains on: the task reward shaped by length, behaviour and hacking monitors.

    changes = workspace_changes(task.workspace, sandbox)   # changes.py: what the episode changed
    report = monitor(traj, changes)                        # monitors.py: did it game its reward?
    shaped = shape(task_reward, passed, traj, usage, cfg)  # shaping.py: minus length, behaviour, hacking

``config.py`` is the ``[reward]`` table of a run config; ``length.py``, ``behaviour.py`` and
``lint.py`` compute the penalty terms.

Test: ``pytest tests/unit/rewards -q``.
"""
