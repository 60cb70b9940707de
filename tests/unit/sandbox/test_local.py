"""Local sandboxes of a SIGKILLed process are cleaned up by the next process that makes one:
its temp dir, its background jobs (setsid'd away, found by their marker) and its state record.

Run: ``pytest tests/unit/sandbox/test_local.py -q``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from testkit.sandbox_testutil import host_pids, wait_gone, wait_present

from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import cleanup
from opencomposer.sandbox.local import LocalSandbox

HOST = r"""
import json, sys, time
from pathlib import Path
from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox.local import LocalSandbox
base, root, token = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
sbs = [LocalSandbox(SandboxSpec(base_dir=base), root=root) for _ in range(2)]
for i, sb in enumerate(sbs):
    sb.write_file("work.txt", b"x")
    sb.exec(f"setsid sleep {token}{i} >/dev/null 2>&1 < /dev/null &")
print(json.dumps([str(sb._root) for sb in sbs]), flush=True)
time.sleep(600)
"""


def test_sandboxes_of_a_sigkilled_process_are_reaped_by_the_next(base_repo, tmp_path, monkeypatch):
    state, root = tmp_path / "state", tmp_path / "sbx"
    root.mkdir()
    monkeypatch.setenv(cleanup.STATE_ENV, str(state))
    token = f"{os.getpid() % 1000 + 95000}"
    host = subprocess.Popen([sys.executable, "-c", HOST, str(base_repo), str(root), token],
                            stdout=subprocess.PIPE, text=True)
    try:
        roots = json.loads(host.stdout.readline())
        assert len(wait_present(f"sleep {token}1", 5.0)) >= 1
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait()
    try:
        # a local sandbox's jobs do not die with their owner: only the next reap ends them
        assert host_pids(f"sleep {token}") and all(Path(r).is_dir() for r in roots)
        records = [json.loads(p.read_text()) for p in state.glob("*.json")]
        assert sorted(r["root"] for r in records) == sorted(roots) and {r["backend"] for r in records} == {"local"}
        with LocalSandbox(SandboxSpec(base_dir=base_repo), root=root) as sb:
            cleanup.reap()  # its constructor reaps once per process, and this one may have made one before
            assert wait_gone(f"sleep {token}", 5.0) == []
            assert cleanup.reap() == {"sandboxes": 0, "processes": 0, "cgroups": 0, "dirs": 0}
            assert sb.exec("echo ok").output == "ok\n"  # a live owner's sandbox is untouched
            assert [p.name for p in root.iterdir()] == [sb._root.name]
            assert len(list(state.glob("*.json"))) == 1
    finally:
        for pid in host_pids(f"sleep {token}"):  # whatever failed above, leave no sleeper
            os.kill(pid, signal.SIGKILL)
    assert wait_gone(f"sleep {token}", 5.0) == []
    assert list(root.iterdir()) == [] and list(state.glob("*.json")) == []


def test_a_fresh_process_reaps_on_its_first_local_sandbox(base_repo, tmp_path):
    state, root = tmp_path / "state", tmp_path / "sbx"
    root.mkdir()
    env = {**os.environ, cleanup.STATE_ENV: str(state)}
    token = f"{os.getpid() % 1000 + 96000}"
    host = subprocess.Popen([sys.executable, "-c", HOST, str(base_repo), str(root), token],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        roots = json.loads(host.stdout.readline())
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait()
    again = ("import sys; from pathlib import Path; from opencomposer.protocols import SandboxSpec; "
             "from opencomposer.sandbox.local import LocalSandbox; "
             "sb = LocalSandbox(SandboxSpec(base_dir=Path(sys.argv[1])), root=sys.argv[2]); sb.close()")
    subprocess.run([sys.executable, "-c", again, str(base_repo), str(root)], env=env, check=True)
    assert wait_gone(f"sleep {token}", 5.0) == []
    assert not any(Path(r).exists() for r in roots) and list(root.iterdir()) == []
    assert list(state.glob("*.json")) == [] and list(state.glob("owner-*.lock")) == []
