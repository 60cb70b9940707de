"""SWE-bench rows -> tasks: a real fix commit of a small git repo becomes a task that
fails before and passes with the gold patch; bad rows are reported by row and field
while the rest import."""

from __future__ import annotations

import json

import pytest
from source_fixtures import ENV

from opencomposer.grading import Carry
from opencomposer.grading.grade import grade, opener, patch_carry
from opencomposer.tasks.format import Task
from opencomposer.tasks.pypi import SourceError
from opencomposer.tasks.sources import ItemError
from opencomposer.tasks.sources.swebench import import_swebench, validate_row


def test_validate_row_names_the_field(minicalc_repo):
    _, row = minicalc_repo
    assert validate_row(row, "r")[0] == ["tests/test_ops.py::test_clamp"]  # JSON-encoded list accepted
    with pytest.raises(ItemError, match=r"rows.jsonl: row 3: missing field\(s\) \['test_patch'\]"):
        validate_row({k: v for k, v in row.items() if k != "test_patch"}, "rows.jsonl: row 3")
    with pytest.raises(ItemError, match="field 'PASS_TO_PASS': expected a list of test ids"):
        validate_row({**row, "PASS_TO_PASS": 7}, "r")
    with pytest.raises(ItemError, match="field 'FAIL_TO_PASS': empty"):
        validate_row({**row, "FAIL_TO_PASS": "[]"}, "r")
    with pytest.raises(ItemError, match="field 'base_commit': expected a non-empty string"):
        validate_row({**row, "base_commit": ""}, "r")


def test_import_good_and_bad_rows(minicalc_repo, tmp_path):
    repo, row = minicalc_repo
    rows = [
        json.dumps(row),
        json.dumps({k: v for k, v in row.items() if k != "FAIL_TO_PASS"} | {"instance_id": "no-f2p"}),
        json.dumps({**row, "instance_id": "other-repo", "repo": "acme/absent"}),
        json.dumps({**row, "instance_id": "bad-commit", "base_commit": "0" * 40}),
        json.dumps({**row, "instance_id": "bad-test-patch", "test_patch": "not a diff"}),
        "{not json",
    ]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(rows) + "\n")
    rep = import_swebench(jsonl, repo.parent, tmp_path / "tasks", env=ENV)
    s = rep.summary()
    assert (s["ok"], s["failed"], s["skipped"]) == (1, 5, 0), s
    why = s["failed_reasons"]
    assert "row 2: missing field(s) ['FAIL_TO_PASS']" in why["no-f2p"]
    assert "row 3: field 'repo': no local git clone of 'acme/absent'" in why["other-repo"]
    assert "row 4: field 'base_commit'" in why["bad-commit"] and "no commit" in why["bad-commit"]
    assert "row 5: field 'test_patch'" in why["bad-test-patch"]
    assert "row 6: not valid JSON" in why["row 6"]

    task = Task.load(tmp_path / "tasks" / rep.ok[0])
    assert task.meta.source.kind == "swebench" and task.meta.source.spec == "acme__minicalc-1"
    assert task.instruction == row["problem_statement"]
    assert task.meta.tests.fail_to_pass == ["tests/test_ops.py::test_clamp"]
    # the workspace is the base commit, nothing applied; the test patch is hidden
    assert "clamp" not in (task.workspace / "minicalc/ops.py").read_text()
    assert "test_clamp" not in (task.workspace / "tests/test_ops.py").read_text()
    assert "test_clamp" in (task.hidden_tests / "tests/test_ops.py").read_text()
    assert (task.hidden_tests / "tests/conftest.py").is_file()
    local = opener("local")
    start = grade(task, Carry(), local)
    assert start.reward == 0.0 and start.details["f2p_passed"] == 0 and start.details["p2p_passed"] == 2
    assert grade(task, patch_carry(task, task.gold_patch, local), local).reward == 1.0


def test_missing_inputs_are_errors(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        import_swebench(tmp_path / "none.jsonl", tmp_path, tmp_path / "out")
    (tmp_path / "r.jsonl").write_text("")
    with pytest.raises(SourceError, match="--repos .*not a directory"):
        import_swebench(tmp_path / "r.jsonl", tmp_path / "nope", tmp_path / "out")
