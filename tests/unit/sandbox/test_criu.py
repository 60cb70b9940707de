"""Memory snapshots with CRIU (host processes of the ``local`` backend).

Where the kernel (or CRIU's view of it) forbids checkpoints, every entry point must say
so with CRIU's own error; where it allows them, a counter process is dumped and
restored and must go on from its saved count, not from zero.
Run: ``pytest tests/unit/sandbox/test_criu.py -q``.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from opencomposer.sandbox import SandboxSpec, make_sandbox
from opencomposer.sandbox.checkpoint import (
    CheckpointUnavailable,
    checkpoint_local,
    criu_unavailable_reason,
    find_criu,
    restore_local,
)

REASON = criu_unavailable_reason()
COUNTER = ("import os, time\nn = 0\nwhile True:\n    n += 1\n    open('.count', 'w').write(str(n))\n"
           "    os.replace('.count', 'count.txt')\n    time.sleep(0.05)\n")  # the file is never seen half-written


def _start_counter(sb) -> int:
    r = sb.exec(f"setsid python3 -c \"{COUNTER}\" > /dev/null 2>&1 < /dev/null & echo $!")
    pid = int(r.output.strip())
    for _ in range(100):
        if sb.exec("cat count.txt 2>/dev/null").output.strip():
            return pid
        time.sleep(0.05)
    raise AssertionError("counter did not start")


@pytest.mark.skipif(REASON is None, reason="CRIU works here: the refusal path is not reachable")
def test_refusal_is_detected_and_names_the_cause(base_repo, tmp_path):
    assert REASON and ("criu" in REASON.lower())
    if find_criu():  # installed but refused by the kernel: CRIU's own lines are quoted
        assert "CRIU cannot checkpoint on this kernel" in REASON and os.uname().release in REASON
    with make_sandbox(SandboxSpec(base_dir=base_repo), backend="local", root=tmp_path) as sb:
        pid = _start_counter(sb)
        with pytest.raises(CheckpointUnavailable) as err:
            checkpoint_local(sb, pid)
        assert str(err.value) == REASON
        assert os.kill(pid, 0) is None  # the process was left alone
        with pytest.raises(CheckpointUnavailable):
            restore_local(sb, None)


@pytest.mark.skipif(REASON is not None, reason=f"criu: {REASON}")
def test_dump_and_restore_a_counter(base_repo, tmp_path):
    with make_sandbox(SandboxSpec(base_dir=base_repo), backend="local", root=tmp_path) as sb:
        pid = _start_counter(sb)
        time.sleep(0.5)
        snap = checkpoint_local(sb, pid)  # the tree is gone after the dump
        saved = int(sb.read_file("count.txt"))
        time.sleep(0.3)
        sb.write_file("count.txt", b"0")
        new_pid = restore_local(sb, snap)
        time.sleep(0.5)
        later = int(sb.read_file("count.txt"))
        os.kill(new_pid, signal.SIGKILL)
        assert saved < later < saved + 100, (saved, later)  # went on from the saved count
