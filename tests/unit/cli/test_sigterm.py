"""SIGTERM to an `opencomposer` process (`kill`, a scheduler's stop, `factory_offline.py`'s shard stop): what its
local sandboxes run goes with it. Before, a factory stopped so left its graders running (session 47: two library
test suites at 100% of a core for 13 minutes, their timeouts gone with the process that kept them), because a local
sandbox's commands run in sessions of their own and nothing reaped them until another process made a sandbox.

A child Python installs the CLI's handler (`opencomposer.cli.main` does the same), makes two local sandboxes and
starts a long command in each (one of them `setsid` away from its group), then gets SIGTERM: it exits 143, every
command is gone at once, and so are the sandboxes' directories and state records.

Run: ``pytest tests/unit/cli/test_sigterm.py -q``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from testkit.sandbox_testutil import host_pids, wait_gone
from opencomposer.sandbox import cleanup

HOST = r"""
import json, signal, sys, threading, time
from pathlib import Path
from opencomposer import cli
from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox.local import LocalSandbox
signal.signal(signal.SIGTERM, cli._on_sigterm)
base, root, token = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
sbs = [LocalSandbox(SandboxSpec(base_dir=base), root=root) for _ in range(2)]
for i, sb in enumerate(sbs):
    cmd = f"sleep {token}{i}" if i == 0 else f"setsid sleep {token}{i}"
    threading.Thread(target=sb.exec, args=(cmd,), kwargs={"timeout": 600}, daemon=True).start()
print(json.dumps([str(sb._root) for sb in sbs]), flush=True)
time.sleep(600)
"""


def test_sigterm_stops_what_local_sandboxes_run_and_removes_them(tmp_path):
    base, root, state = tmp_path / "repo", tmp_path / "sbx", tmp_path / "state"
    base.mkdir()
    (base / "a.py").write_text("x = 1\n")
    root.mkdir()
    token = f"{os.getpid() % 1000 + 95000}"
    host = subprocess.Popen([sys.executable, "-c", HOST, str(base), str(root), token], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, cleanup.STATE_ENV: str(state)}, text=True)
    try:
        roots = json.loads(host.stdout.readline())
        end = time.monotonic() + 10
        while len(host_pids(f"sleep {token}")) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        assert len(host_pids(f"sleep {token}")) == 2
        assert len(list(state.glob("*.json"))) == 2
        host.send_signal(signal.SIGTERM)
        assert host.wait(30) == 128 + signal.SIGTERM
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
    assert "2 sandbox(es)" in host.stderr.read()
    assert wait_gone(f"sleep {token}", 5.0) == []  # at once: no other process had to make a sandbox first
    assert not any(Path(r).exists() for r in roots)
    assert list(state.glob("*.json")) == []
