"""A factory run killed mid-library resumes where it stopped: rerunning the same command skips
the candidates the journal says were tried, reuses the cached preparation (no reinstall, no
baseline reruns) and reports totals over both sessions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_factory import CORE, TESTS, UTIL
from testkit.dists import make_sdist

from opencomposer.grading.check import check_task
from opencomposer.tasks.format import find_tasks

CLI = [sys.executable, "-m", "opencomposer.cli", "tasks", "make"]


def _journal(out: Path) -> list[dict]:
    (path,) = (out / "_journal").glob("*.jsonl")
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.slow  # one small venv, three suite runs, then ~15 candidates over two sessions
def test_killed_run_resumes_where_it_stopped(tmp_path: Path) -> None:
    sdist = make_sdist(tmp_path, "minilib", {
        "minilib/__init__.py": "", "minilib/core.py": CORE, "minilib/util.py": UTIL,
        "tests/test_core.py": TESTS.format(counter=str(tmp_path / "flaky-count"))})
    cfg = tmp_path / "factory.toml"
    # backend local by name: test_flaky counts its runs in a file on the host
    cfg.write_text(f'[factory]\nmax_per_library = 50\nworkers = 1\ntest_timeout = 120\nbackend = "local"\n'
                   f'[difficulty]\nposition = 2.0\nwidth = 4.0\n[[libraries]]\nspec = "{sdist}"\n')
    out = tmp_path / "tasks"
    cmd = CLI + ["--config", str(cfg), "--out", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                             start_new_session=True)
    deadline = time.time() + 300
    try:
        while time.time() < deadline:  # kill it as soon as it has made one task
            if (out / "_journal").is_dir() and any(ln.get("task") for ln in _journal(out)):
                break
            assert first.poll() is None, first.communicate()
            time.sleep(0.2)
        else:
            pytest.fail("no task made in 300 s")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    before = _journal(out)
    tried_first = [ln["key"] for ln in before if "key" in ln]
    made_first = [ln["task"] for ln in before if ln.get("task")]
    assert made_first and all((out / t / "task.toml").exists() for t in made_first)
    assert not any(ln.get("event") == "stopped" for ln in before)  # it really was cut short

    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    lib = summary["per_library"][str(sdist)]
    after = _journal(out)[len(before):]
    assert after[0]["event"] == "prepared" and after[0]["install"] == "cached"  # no reinstall, no reruns
    retried = [ln["key"] for ln in after if "key" in ln and ln["key"] in tried_first]
    assert not retried, f"tried again after the resume: {retried}"
    assert lib["resumed"] == len(set(tried_first)) and lib["tried"] == len(set(tried_first)) + sum(
        "key" in ln for ln in after)
    tasks = find_tasks([out])
    assert lib["made"] == summary["made"] == len(tasks) > len(made_first)
    assert lib["seconds"] >= before[-1]["s"]  # the killed session's time is counted
    for p in tasks[:3]:
        res = check_task(p, "local")
        assert res.ok, res.problems
