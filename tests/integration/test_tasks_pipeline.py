"""End to end on a real library: make tasks, check them, solve them with the oracle.

Run: ``pytest tests/integration/test_tasks_pipeline.py`` (about two minutes; needs PyPI).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import BACKENDS, run_cli
from testkit.dists import make_sdist
from opencomposer.policies.oracle import OraclePolicy
from opencomposer.episode.run import run_task
from opencomposer.grading.check import check_task
from opencomposer.tasks.format import Task, find_tasks
from opencomposer.tasks.make import make_tasks
from opencomposer.tasks.pypi import SourceError


def test_made_tasks_keep_hidden_things_apart(toolz_tasks: Path):
    for p in find_tasks([toolz_tasks]):
        t = Task.load(p)
        ws = t.workspace
        assert len(t.instruction) < 400
        assert t.meta.tests.fail_to_pass and t.meta.tests.pass_to_pass
        # the test files holding FAIL_TO_PASS tests are not in the workspace, only hidden
        for node in t.meta.tests.fail_to_pass:
            rel = node.split("::")[0]
            assert not (ws / rel).exists() and (t.hidden_tests / rel).exists()
        # fresh single-commit history, no caches
        log = subprocess.run(["git", "-C", str(ws), "rev-list", "--all", "--count"], capture_output=True, text=True)
        assert log.stdout.strip() == "1"
        assert not list(ws.rglob("__pycache__")) and not list(ws.rglob("*.pyc"))
        assert not list(ws.rglob("*.egg-info"))
        # the env holds the deps and pytest, but neither the library nor installer tools
        # (setuptools vendors more_itertools; pip vendors many libraries)
        site = next(t.env_dir.glob("lib/python3*/site-packages"))
        assert (site / "pytest").is_dir() or (site / "_pytest").is_dir()
        assert not (site / "toolz").exists() and not (site / "setuptools").exists() and not (site / "pip").exists()
        # the deleted code is not in the workspace file
        added = [l[1:].strip() for l in t.gold_patch.splitlines() if l.startswith("+") and not l.startswith("+++")]
        body = (ws / t.meta.feature.file).read_text()
        assert any(a and a not in body for a in added)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tasks_check_and_oracle_solve(toolz_tasks: Path, backend: str):
    paths = find_tasks([toolz_tasks])
    for p in paths:
        res = check_task(p, backend)
        assert res.ok, res.problems
        assert res.leak_channels, "the probe reports the channels it searched"
        task = Task.load(p)
        ep = run_task(task, OraclePolicy(task), backend)
        assert ep.reward.reward == 1.0, ep.reward.details
        assert ep.trajectory.exit_reason == "submitted"
        names = [e.name for s in ep.trajectory.steps for e in s.tool_events]
        assert {"list_dir", "read_file", "run", "submit"} <= set(names)


def test_unsolved_workspace_scores_zero(toolz_tasks: Path):
    from opencomposer.policies.scripted import ScriptedPolicy, tool_call
    task = Task.load(find_tasks([toolz_tasks])[0])
    ep = run_task(task, ScriptedPolicy([[tool_call("submit", message="done")]]), "local")
    assert ep.reward.reward == 0.0
    assert ep.reward.details["f2p_passed"] < len(task.meta.tests.fail_to_pass)


def test_cli_check_and_list_print_json_last(toolz_tasks: Path):
    r = run_cli("tasks", "check", str(toolz_tasks))
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and last["checked"] == 4 and last["ok"] == 4 and last["leaks"] == 0
    r = run_cli("tasks", "list", str(toolz_tasks))
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["tasks"] == 4 and last["median_instruction_chars"] < 400


def test_cli_check_of_a_pool_in_sittings_with_a_report(toolz_tasks: Path, tmp_path: Path):
    """``--sample`` draws tasks, ``--report`` keeps a line a task and a rerun checks only what it lacks (a torn
    last line, a run killed mid-write, is checked again); ``--no-leaks`` grades without the leak probe."""
    report = tmp_path / "check.jsonl"
    r = run_cli("tasks", "check", str(toolz_tasks), "--sample", "2", "--seed", "1", "--no-leaks", "--report", str(report))
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr
    assert last["checked"] == 2 and last["ok"] == 2 and last["leaks"] is None and last["checked_before"] == 0
    rows = [json.loads(x) for x in report.read_text().splitlines()]
    assert len(rows) == 2 and all(x["ok"] and x["leak_channels"] == {} for x in rows)
    report.write_text(report.read_text() + '{"task": "torn')  # killed while writing a third line
    r = run_cli("tasks", "check", str(toolz_tasks), "--no-leaks", "--report", str(report))
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and last["checked"] == 4 and last["ok"] == 4 and last["checked_before"] == 2
    rows = [json.loads(x) for x in report.read_text().splitlines()]  # the torn line dropped, two more after
    assert len(rows) == 4 and len({x["task"] for x in rows}) == 4
    report.write_text("not json\n" + report.read_text())
    r = run_cli("tasks", "check", str(toolz_tasks), "--report", str(report))
    assert r.returncode == 2
    assert json.loads(r.stdout.strip().splitlines()[-1])["error"].startswith(f"{report}:1: not a line of `tasks check --report`")


def test_cli_agent_oracle(toolz_tasks: Path, tmp_path: Path):
    task = find_tasks([toolz_tasks])[0]
    tr = tmp_path / "t.json"
    r = run_cli("agent", "--task", str(task), "--policy", "oracle", "--transcript", str(tr))
    assert r.returncode == 0, r.stderr
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["reward"] == 1.0 and last["invalid_calls"] == 0 and last["turns"] >= 4
    saved = json.loads(tr.read_text())
    assert saved["exit_reason"] == "submitted" and saved["steps"]


def test_sdist_without_tests_is_refused(tmp_path: Path):
    sd = make_sdist(tmp_path, "notests", {"notests/__init__.py": "def f(x):\n    return x\n"})
    with pytest.raises(SourceError, match="ships no test files"):
        make_tasks(f"pypi:{sd}", tmp_path / "out", max_tasks=1)


def test_library_whose_tests_cannot_run_is_refused(tmp_path: Path):
    sd = make_sdist(tmp_path, "broken", {
        "broken/__init__.py": "import does_not_exist_anywhere\n",
        "tests/test_broken.py": "import broken\n\ndef test_one():\n    assert broken\n",
    })
    with pytest.raises(SourceError, match="tests cannot run"):
        make_tasks(f"pypi:{sd}", tmp_path / "out", max_tasks=1)
    r = run_cli("tasks", "make", "--source", f"pypi:{sd}", "--out", str(tmp_path / "out2"))
    assert r.returncode == 2 and "tests cannot run" in r.stderr
    assert "error" in json.loads(r.stdout.strip().splitlines()[-1])
