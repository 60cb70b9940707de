"""``tasks pack`` / ``tasks unpack`` on real toolz tasks: the env is rebuilt from the carried wheels
with the index disabled, and the unpacked tasks check and the oracle solves them.

Needs PyPI at pack time only (the toolz tasks and the wheels); unpack runs with ``PIP_NO_INDEX=1``.
Run: ``pytest -q tests/integration/test_tasks_pack.py`` (about 2 minutes).
"""

from __future__ import annotations

import hashlib
import json

from conftest import run_cli

from opencomposer.episode.oracle import run_oracle
from opencomposer.grading.check import check_task
from opencomposer.tasks.format import Task, task_dirs


def sums(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in task_dirs(root) for p in sorted(d.rglob("*")) if p.is_file() and not p.is_symlink()}


def test_toolz_tasks_pack_unpack_offline_check_and_solve(toolz_tasks, tmp_path, monkeypatch):
    r = run_cli("tasks", "pack", str(toolz_tasks), "-o", str(tmp_path / "toolz.ocpack"), "--part-size", "1M")
    assert r.returncode == 0, r.stderr
    packed = json.loads(r.stdout.strip().splitlines()[-1])
    assert packed["tasks"] == 4 and packed["objects"] < packed["files"] / 2  # the library stored once
    assert all(e["wheels"] == e["installed"] > 0 for e in packed["envs"].values())
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    r = run_cli("tasks", "unpack", packed["parts"][0], "-o", str(tmp_path / "gpu"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["envs"] == list(packed["envs"])
    out = tmp_path / "gpu"
    assert sums(out) == sums(toolz_tasks)
    first = task_dirs(out)[0]
    res = check_task(first, "local")
    assert res.ok, res.problems
    assert run_oracle([Task.load(first)], "local", workers=1)[0]["reward"] == 1.0
