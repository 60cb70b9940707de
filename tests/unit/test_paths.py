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
with held_lock("thing", shared=sys.argv[1] == "shared"):
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


def _holder(cache: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "OPENCOMPOSER_CACHE": str(cache)})


def _can_take(cache: Path, kind: int) -> bool:
    """Whether this process would get the lock ``thing`` (``fcntl.LOCK_SH`` or ``LOCK_EX``) at once."""
    fd = os.open(cache / "locks" / "thing.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_readers_share_a_lock_that_keeps_the_builder_out(tmp_path, monkeypatch):
    """A model being loaded (shared) cannot be swapped out by a builder (exclusive) until the
    readers are done; readers do not wait for each other."""
    monkeypatch.setenv("OPENCOMPOSER_CACHE", str(tmp_path))
    reader = _holder(tmp_path, "shared")
    try:
        assert reader.stdout.readline().strip() == "held"
        assert _can_take(tmp_path, fcntl.LOCK_SH)  # a second reader: at once
        assert not _can_take(tmp_path, fcntl.LOCK_EX)  # a builder: not while one reads
        reader.stdin.close()  # the reader finishes
        assert reader.wait(30) == 0
    finally:
        reader.kill()
    assert _can_take(tmp_path, fcntl.LOCK_EX)  # and then the builder gets it


def test_a_lock_is_held_by_one_at_a_time_and_dropped_when_its_holder_dies(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCOMPOSER_CACHE", str(tmp_path))
    holder = _holder(tmp_path, "exclusive")
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not _can_take(tmp_path, fcntl.LOCK_SH) and not _can_take(tmp_path, fcntl.LOCK_EX)
        holder.kill()
        assert holder.wait(30) == -signal.SIGKILL
    finally:
        holder.kill()
    done = []
    with held_lock("thing"):  # the dead holder's lock went with it: no wait
        done.append(1)
    assert done == [1]
