"""The agent's commands cannot act on the sandbox's PID 1 (the exec server, non-dumpable):
no ptrace, no write to its memory, no signal that stops or kills it.

    pytest -q tests/adversarial/test_sandbox_reach.py
"""

from __future__ import annotations

import re

from opencomposer.sandbox import make_sandbox

PTRACE = ("python -c 'import ctypes, os; l = ctypes.CDLL(None, use_errno=True); "
          "r = l.ptrace(16, 1, 0, 0); print(\"ptrace\", r, os.strerror(ctypes.get_errno()))'")
MEM = ("python -c \"\nimport os\ntry:\n    open('/proc/1/mem', 'r+b').write(b'x'); print('mem writable')\n"
       "except OSError as e:\n    print('mem', e.errno)\n\"")


def test_ptrace_and_proc_mem_of_pid1_fail(backend: str, toolz_tasks) -> None:
    with make_sandbox(toolz_tasks[0].sandbox_spec(), backend) as sb:
        r = sb.exec(PTRACE, timeout=30)
        assert "ptrace -1 Operation not permitted" in r.output, r.output
        r = sb.exec(MEM, timeout=30)
        assert re.search(r"^mem (13|1)$", r.output, re.MULTILINE), r.output  # EACCES or EPERM
        assert "mem writable" not in r.output


def test_signals_to_pid1_leave_the_sandbox_working(backend: str, toolz_tasks) -> None:
    with make_sandbox(toolz_tasks[0].sandbox_spec(), backend) as sb:
        sb.exec("kill -STOP 1; kill -9 1; kill -9 -1", timeout=30)
        r = sb.exec("echo alive", timeout=30)
        assert r.exit_code == 0 and "alive" in r.output, r.output
