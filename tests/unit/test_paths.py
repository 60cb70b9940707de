"""Staged dirs and their temps: a reader never sees half a dir, and what a SIGKILLed writer
left is removed by the next run while a live writer's temp is kept.

Run: ``pytest tests/unit/test_paths.py``.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opencomposer.paths import held_lock, is_stale_temp, remove_stale_temps, staged_dir, temp_name

KILLED = r"""
import os, signal, sys
from pathlib import Path
from opencomposer.paths import staged_dir
with staged_dir(Path(sys.argv[1])) as tmp:
    (tmp / "half").write_text("x")
    print(tmp, flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()
"""


HOLDER = r"""
import sys
from opencomposer.paths import held_lock
with held_lock("thing"):
    print("held", flush=True)
    sys.stdin.read()
"""


def _writer(final: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(final), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, Path(proc.stdout.readline().strip())


def test_staged_dir_replaces_whole_or_not_at_all(tmp_path):
    final = tmp_path / "task"
    with staged_dir(final) as tmp:
        (tmp / "a").write_text("1")
        assert tmp.name.startswith(".task.tmp-") and not final.exists()
    assert (final / "a").read_text() == "1"
    with pytest.raises(RuntimeError), staged_dir(final) as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError("half way")
    assert (final / "a").read_text() == "1" and [p.name for p in tmp_path.iterdir()] == ["task"]
    with staged_dir(final) as tmp:
        (tmp / "b").write_text("3")
    assert [p.name for p in final.iterdir()] == ["b"] and [p.name for p in tmp_path.iterdir()] == ["task"]


def test_a_killed_writers_temp_goes_and_a_live_ones_stays(tmp_path):
    dead, dead_tmp = _writer(tmp_path / "one", "die")
    assert dead.wait(30) == -signal.SIGKILL and dead_tmp.is_dir()
    live, live_tmp = _writer(tmp_path / "two", "live")
    try:
        assert is_stale_temp(dead_tmp) and not is_stale_temp(live_tmp)
        assert remove_stale_temps(tmp_path) == [dead_tmp.name]
        assert not dead_tmp.exists() and live_tmp.is_dir()
    finally:
        live.communicate("")
    assert (tmp_path / "two" / "half").is_file() and not live_tmp.exists()


def test_another_hosts_temp_goes_only_when_old(tmp_path):
    other = tmp_path / ".x.tmp-otherhost-1-0123abcd"
    other.mkdir()
    assert not is_stale_temp(other)
    old = time.time() - 2 * 24 * 3600
    os.utime(other, (old, old))
    assert is_stale_temp(other)
    mine = temp_name(tmp_path / "x")
    mine.mkdir()
    assert not is_stale_temp(mine)  # this process is alive
    assert not is_stale_temp(tmp_path / "plain")  # not a temp name: never touched


def test_an_empty_cache_variable_means_the_default_not_the_current_directory(monkeypatch, tmp_path):
    from opencomposer.paths import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("OPENCOMPOSER_CACHE", "")
    assert cache_dir("x") == tmp_path / ".cache" / "opencomposer" / "x"
    monkeypatch.setenv("OPENCOMPOSER_CACHE", str(tmp_path / "c"))
    assert cache_dir("x") == tmp_path / "c" / "x"


def test_a_lock_is_held_by_one_at_a_time_and_dropped_when_its_holder_dies(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCOMPOSER_CACHE", str(tmp_path))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "OPENCOMPOSER_CACHE": str(tmp_path)})
    try:
        assert holder.stdout.readline().strip() == "held"
        fd = os.open(tmp_path / "locks" / "thing.lock", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        holder.kill()
        assert holder.wait(30) == -signal.SIGKILL
    finally:
        holder.kill()
    done = []
    with held_lock("thing"):  # the dead holder's lock went with it: no wait
        done.append(1)
    assert done == [1]
