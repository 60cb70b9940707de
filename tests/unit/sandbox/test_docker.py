"""The Docker backend against a real engine (skipped, saying why, where none answers).

Run: ``pytest tests/unit/sandbox/test_docker.py -q`` (~1 s per command: keep them few).
A local engine for it: ``apt-get install -y docker.io && dockerd --bridge=none --iptables=false &``.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from opencomposer.protocols import PathEscape, Sandbox, SandboxSpec
from opencomposer.sandbox import make_sandbox
from opencomposer.sandbox.docker import LABEL, DockerSandbox, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"docker: {REASON}")


def _containers(sandbox_id: str) -> list[str]:
    r = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={LABEL}={sandbox_id}"], capture_output=True, text=True)
    return r.stdout.split()


@pytest.fixture
def dsb(base_repo, venv_dir, tmp_path):
    sb = make_sandbox(SandboxSpec(base_dir=base_repo, env_dir=venv_dir, pythonpath=["pkg"], extra_env={"FROM_SPEC": "1"}),
                      backend="docker", root=tmp_path)
    yield sb
    sb.close()


def test_commands_run_in_a_container_with_the_task_env(dsb, venv_dir, monkeypatch):
    assert isinstance(dsb, Sandbox) and isinstance(dsb, DockerSandbox) and dsb.workdir == "/workspace"
    monkeypatch.setenv("OC_HOST_SECRET", "leaked")
    r = dsb.exec(
        "python -c 'import sys, mod; print(sys.prefix, mod.add(2, 3))'; pwd; env; "
        "test -e /work || echo no-work; (echo x > /usr/oc-probe) 2>/dev/null || echo usr-read-only; "
        "python3 -c 'import socket; print(sorted(n for _, n in socket.if_nameindex()))'; cat; exit 3",
        stdin=b"from-stdin", env={"PER_CALL": "2"}, cwd="pkg",
    )
    assert r.exit_code == 3 and not r.timed_out, r.output
    assert f"{venv_dir} 5\n" in r.output and "/workspace/pkg\n" in r.output and r.output.endswith("from-stdin")
    assert "FROM_SPEC=1" in r.output and "PER_CALL=2" in r.output and "OC_HOST_SECRET" not in r.output
    assert "no-work\nusr-read-only\n['lo']\n" in r.output  # host hidden, /usr read-only, no network


def test_files_snapshot_restore_fork_and_escape(dsb):
    dsb.write_file("notes/a.txt", b"one")
    assert dsb.exec("cat notes/a.txt; echo two > notes/b.txt").output == "one"
    assert dsb.read_file("notes/b.txt") == b"two\n"
    st = os.stat(dsb._host_path("notes/b.txt"))
    assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())  # files stay the caller's
    sid = dsb.snapshot()
    dsb.write_file("pkg/mod.py", b"broken")
    child = dsb.fork()
    try:
        assert child.backend == "docker" and child.read_file("pkg/mod.py") == b"broken"
        dsb.restore(sid)
        assert dsb.exec("head -c 7 pkg/mod.py").output == "def add"
        child.reset()
        assert child.read_file("pkg/mod.py") == b"broken"
    finally:
        child.close()
    dsb.exec("ln -s /etc/passwd evil")
    with pytest.raises(PathEscape):
        dsb.read_file("evil")


def test_timeout_removes_the_container_and_close_leaves_nothing(base_repo, tmp_path):
    sb = DockerSandbox(SandboxSpec(base_dir=base_repo), root=tmp_path)
    r = sb.exec("sleep 60", timeout=1)
    assert r.timed_out and "timed out" in r.output
    assert _containers(sb.id) == []  # killing the CLI alone would leave it running
    subprocess.run(["docker", "run", "-d", "--label", f"{LABEL}={sb.id}", "--network", "none",
                    "--mount", "type=bind,src=/usr,dst=/usr,readonly", sb._image, "/usr/bin/sleep", "60"],
                   check=True, capture_output=True)  # a straggler close() must find by label
    root = sb._root
    sb.close()
    assert _containers(sb.id) == [] and not root.exists()
