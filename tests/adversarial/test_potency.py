"""The planted payloads are real: let one reach the runner and every one of the task's tests passes.

Grades hand-built carries that skip ``collect`` (the carry filter) on one task: each start-up
hook of the strategies, given to the grader as a file of the workspace, makes every
FAIL_TO_PASS test pass. So the strategies' reward of 0 is the carry filter's doing, not a dud
payload's. The second line of defence shows too: the payload spares the canary by its old
form (a file ``test_<hex>.py``), but the canary now hides among the task's own tests as a copy
of one of them, so it passes too and gives the forgery away.
(A ``pytest.ini`` addopts would not act even then: every task command passes ``-o addopts=``.)

    pytest -q tests/adversarial/test_potency.py
"""

from __future__ import annotations

import pytest
from forgeries import LOAD_PLUGIN, PASS_ALL_PLUGIN

from opencomposer.grading import grade
from opencomposer.grading.carry import Carry
from opencomposer.grading.grade import opener

FORGE = "toolz/_oc_forge.py"
PLANTED = {
    "conftest": {"conftest.py": PASS_ALL_PLUGIN},
    "sitecustomize": {"sitecustomize.py": LOAD_PLUGIN, FORGE: PASS_ALL_PLUGIN},
    "dist-info": {"oc_forge-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: oc-forge\nVersion: 1.0\n",
                  "oc_forge-1.0.dist-info/entry_points.txt": "[pytest11]\nforge = toolz._oc_forge\n", FORGE: PASS_ALL_PLUGIN},
}


@pytest.mark.parametrize("planted", list(PLANTED))
def test_payload_forges_when_it_reaches_the_runner(planted: str, backend: str, toolz_tasks) -> None:
    task = toolz_tasks[2]
    files = {p: c.encode() for p, c in PLANTED[planted].items()}
    res = grade(task, Carry(files=files), opener(backend))
    assert set(res.details["fail_to_pass"].values()) == {"PASSED"}, res.details["fail_to_pass"]
    assert res.details["canary"] == "PASSED" and "canary" in res.details["tampered"], res.details["report"]
    assert res.reward == 0.0
