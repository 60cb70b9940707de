"""``tasks make`` SIGKILLed at any moment and run again yields each task exactly once.

A real ``opencomposer tasks make --source pypi:toolz==1.2.0`` (PyPI: the sdist and pytest for
its env) is killed twice: while a task is being built in its staging dir, and right after a
task was renamed into place (before or after its journal line). While it lies dead, no
reader lists a staging dir; the third run finishes, removes the dead runs' staging dirs and
ends with every task id once on disk and once in the journal.

Run: ``pytest tests/integration/test_tasks_make_killed.py`` (the first run builds the env).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from testkit.rl_tasks import TOOLZ

from opencomposer.tasks.format import Task, find_tasks, task_dirs

MAX = 3


def _cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "opencomposer.cli", "tasks", "make", "--source", TOOLZ, "--out", str(out),
            "--max", str(MAX), "--seed", "1", "--sandbox", "local", "--workers", "1"]


def _staging(out: Path) -> list[Path]:
    return [p for p in out.iterdir() if p.name.startswith(".") and ".tmp-" in p.name] if out.is_dir() else []


def _kill_when(out: Path, seen, timeout: float = 240.0) -> None:
    """Start ``tasks make`` and SIGKILL its process group the moment ``seen(out)`` holds."""
    proc = subprocess.Popen(_cmd(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    end = time.monotonic() + timeout
    try:
        while not seen(out):
            if proc.poll() is not None:
                pytest.fail(f"tasks make ended before the kill point: {proc.communicate()[1].decode()[-2000:]}")
            if time.monotonic() > end:
                pytest.fail(f"no kill point in {timeout} s")
            time.sleep(0.002)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _journal_made(out: Path) -> list[str]:
    lines = []
    for path in (out / "_journal").glob("*.jsonl"):
        for raw in path.read_text().splitlines():
            try:
                lines.append(json.loads(raw))
            except ValueError:
                continue  # a line cut by the kill
    return [ln["task"] for ln in lines if ln.get("task")]


def _readers_see_no_staging(out: Path) -> None:
    listed = [p for p in find_tasks([out]) if p != out]  # (an empty dir is given back as itself)
    assert not any(p.name.startswith(".") for p in listed)
    assert listed == task_dirs(out)
    for p in listed:  # every listed task is whole
        Task.load(p)


@pytest.mark.slow  # builds toolz's env (pip, from PyPI) and runs its suite three times, once
def test_killed_tasks_make_reruns_to_each_task_once(tmp_path):
    out = tmp_path / "tasks"
    # 1. killed while the first task is in its staging dir
    _kill_when(out, lambda o: bool(_staging(o)))
    left = _staging(out)
    assert left, "the kill came after the rename; the staging dir was gone"  # a half-made task lies there
    _readers_see_no_staging(out)
    # 2. killed right after a task was renamed into place (its journal line may not be written)
    had = {p.name for p in task_dirs(out)}
    _kill_when(out, lambda o: bool({p.name for p in task_dirs(o)} - had))
    _readers_see_no_staging(out)
    assert task_dirs(out)

    r = subprocess.run(_cmd(out), capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    tasks = task_dirs(out)
    ids = [Task.load(p).id for p in tasks]
    assert len(ids) == MAX and sorted(ids) == sorted(p.name for p in tasks)
    assert Counter(_journal_made(out)) == Counter(ids), _journal_made(out)  # each made once, no more
    assert _staging(out) == [] and not any(p.exists() for p in left)  # the dead runs' staging dirs are gone
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["made"] == MAX
