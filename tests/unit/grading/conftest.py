"""A real small task for the grader's tests: the SWE-bench fixture's minicalc fix (``clamp``), imported
into a task that runs in this interpreter's env (it has pytest); see ``tasks/sources/source_fixtures.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tasks" / "sources"))
from source_fixtures import ENV, minicalc_repo  # noqa: E402,F401

from opencomposer.tasks.format import Task  # noqa: E402
from opencomposer.tasks.sources.swebench import import_swebench  # noqa: E402


@pytest.fixture(scope="session")
def minicalc_task(minicalc_repo, tmp_path_factory) -> Task:  # noqa: F811
    repo, row = minicalc_repo
    out = tmp_path_factory.mktemp("grading")
    (out / "rows.jsonl").write_text(json.dumps(row) + "\n")
    rep = import_swebench(out / "rows.jsonl", repo.parent, out / "tasks", env=ENV)
    assert rep.ok, rep.summary()
    return Task.load(out / "tasks" / rep.ok[0])
