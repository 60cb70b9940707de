"""Grading: the hidden tests run where the agent never ran, on the agent's code changes alone.

    carry = collect(task.workspace, episode_sandbox, changes)   # carry.py: what is carried, what refused
    reward = grade(task, carry, open_sandbox)                   # grade.py: a fresh sandbox, tests laid last
    tasks.testrun.PytestRun                                     # the launcher: outcomes from a nonce report
    check.check_task(path, backend)                             # check.py: validate a task dir through the grader

Test: ``pytest tests/unit/grading -q``; the reward-forging suite: ``pytest tests/adversarial -q``.
"""

from opencomposer.grading.carry import Carry, collect
from opencomposer.grading.grade import grade

__all__ = ["Carry", "collect", "grade"]
