"""Nothing is left behind after a sandbox host is SIGKILLed, once a host starts again.

A child Python makes namespace sandboxes and starts long commands in them, then gets
SIGKILL: the sandboxes' exec servers see their control pipe close and take every
process of their sandbox with them at once. A second, fresh Python makes one sandbox
(which reaps on first use); then no cgroup, temp dir or state record of the dead host
may remain either.

Run: ``pytest tests/unit/sandbox/test_cleanup.py -q``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit.sandbox_testutil import NEEDS_NS, host_pids, wait_gone
from opencomposer.sandbox import cleanup

pytestmark = NEEDS_NS

HOST = r"""
import json, sys, threading, time
from pathlib import Path
from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox.namespace import NamespaceSandbox
base, root, token = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
sbs = [NamespaceSandbox(SandboxSpec(base_dir=base), root=root) for _ in range(3)]
for i, sb in enumerate(sbs):
    sb.write_file("work.txt", b"x")
    sb.snapshot()
    threading.Thread(target=sb.exec, args=(f"sleep {token}{i} & setsid sleep {token}{i}",),
                     kwargs={"timeout": 600}, daemon=True).start()
print(json.dumps([{"root": str(sb._root), "cgroups": sb._limiter.cgroup_dirs()} for sb in sbs]), flush=True)
time.sleep(600)
"""

RESTART = r"""
import sys
from pathlib import Path
from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox.namespace import NamespaceSandbox
with NamespaceSandbox(SandboxSpec(base_dir=Path(sys.argv[1])), root=sys.argv[2]) as sb:
    assert sb.exec("echo ok").output == "ok\n"
"""


def _env(state: Path) -> dict[str, str]:
    return {**os.environ, cleanup.STATE_ENV: str(state)}


def test_sigkilled_host_leaves_nothing_after_restart(base_repo, tmp_path):
    state, root = tmp_path / "state", tmp_path / "sbx"
    root.mkdir()
    token = f"{os.getpid() % 1000 + 94000}"
    host = subprocess.Popen([sys.executable, "-c", HOST, str(base_repo), str(root), token],
                            stdout=subprocess.PIPE, env=_env(state), text=True)
    try:
        made = json.loads(host.stdout.readline())
        end = time.monotonic() + 10
        while len(host_pids(f"sleep {token}")) < 6 and time.monotonic() < end:
            time.sleep(0.05)
        assert len(host_pids(f"sleep {token}")) >= 6  # two sleeps in each of three sandboxes (+ their shells)
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait()
    try:
        # The exec servers see their control pipe close and end: no process of the dead
        # host's sandboxes outlives it, even before any host starts again.
        assert wait_gone(f"sleep {token}", 5.0) == []
        assert not any(wait_gone(m["root"], 5.0) for m in made)  # bwrap and the servers name their dir
        assert len(list(state.glob("*.json"))) == 3  # the records outlive their owner
        assert all(Path(m["root"]).exists() for m in made)
    finally:  # a restarted host reaps the rest, whatever failed above
        subprocess.run([sys.executable, "-c", RESTART, str(base_repo), str(root)], env=_env(state), check=True)

    end = time.monotonic() + 5
    while host_pids(f"sleep {token}") and time.monotonic() < end:
        time.sleep(0.05)
    assert host_pids(f"sleep {token}") == []
    assert list(root.iterdir()) == []
    assert not any(os.path.exists(cg) for m in made for cg in m["cgroups"])
    assert list(state.glob("*.json")) == [] and list(state.glob("owner-*.lock")) == []
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(root) not in mounts


def test_reap_spares_live_owners_and_counts(base_repo, tmp_path, monkeypatch):
    from opencomposer.sandbox.namespace import NamespaceSandbox
    from opencomposer.protocols import SandboxSpec

    state = tmp_path / "state"
    monkeypatch.setenv(cleanup.STATE_ENV, str(state))
    with NamespaceSandbox(SandboxSpec(base_dir=base_repo), root=tmp_path) as sb:
        assert cleanup.reap() == {"sandboxes": 0, "processes": 0, "cgroups": 0, "dirs": 0}
        assert sb._root.exists() and len(list(state.glob("*.json"))) == 1
        # A record of a dead owner: a lock file nobody holds, a temp dir, a stray process.
        stray_root = tmp_path / "oc-ns-dead"
        stray_root.mkdir()
        # One process naming the dir (a bash -c would fork a second one that names it too).
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", str(stray_root)])
        while str(stray_root).encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
            time.sleep(0.01)  # until the child has exec'd
        lock = state / "owner-999999999.lock"
        lock.touch()
        (state / "dead.json").write_text(json.dumps({"owner_lock": str(lock), "root": str(stray_root), "cgroups": []}))
        counts = cleanup.reap()
        assert counts == {"sandboxes": 1, "processes": 1, "cgroups": 0, "dirs": 1}
        assert proc.wait(5) == -signal.SIGKILL and not stray_root.exists() and not lock.exists()
        assert sb.exec("echo ok").output == "ok\n"  # our own sandbox untouched
    assert list(state.glob("*.json")) == []


def test_cleanup_module_prints_one_json_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "opencomposer.sandbox.cleanup"], capture_output=True, text=True,
                       env=_env(tmp_path / "state"), check=True)
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["sandboxes"] == 0 and last["state_dir"] == str(tmp_path / "state")


@pytest.mark.parametrize("body", ["{not json", json.dumps({"root": "/x"})])
def test_unreadable_records_are_skipped(tmp_path, monkeypatch, body):
    monkeypatch.setenv(cleanup.STATE_ENV, str(tmp_path))
    (tmp_path / "bad.json").write_text(body)
    assert cleanup.reap()["sandboxes"] == 0


def test_reap_leaves_a_record_being_written_alone(tmp_path, monkeypatch):
    """Another process may be between writing a record's tmp file and renaming it: reap()
    must not delete that file (CI: an episode's register() then failed on the rename).
    Only tmp files older than the grace period are a dead writer's leftovers."""
    monkeypatch.setenv(cleanup.STATE_ENV, str(tmp_path))
    fresh, stale = tmp_path / ".aaaa.json.tmp", tmp_path / ".bbbb.json.tmp"
    fresh.write_text("{}")
    stale.write_text("{}")
    old = time.time() - cleanup.TMP_GRACE_S - 5
    os.utime(stale, (old, old))
    cleanup.reap()
    assert fresh.exists() and not stale.exists()


def test_a_tree_another_reaper_removes_at_the_same_time_is_no_error(tmp_path, monkeypatch):
    """Two processes starting sandboxes reap the same dead sandbox: whatever the other removed first is gone,
    not an error (session 34: a second grader process died on FileNotFoundError at its first sandbox)."""
    import os

    from opencomposer.sandbox import base

    root = tmp_path / "oc-ns-dead"
    (root / "work" / "work").mkdir(parents=True)
    (root / "work" / "f").write_text("x")
    real_unlink = os.unlink

    def raced(p, *a, **k):  # the other reaper took the file just before us
        real_unlink(p, *a, **k)
        raise FileNotFoundError(2, "No such file or directory", p)

    monkeypatch.setattr(os, "unlink", raced)
    base.remove_tree(root)
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert not root.exists()
