"""Isolation that only the namespace backend promises: no network, hidden host, read-only system.

Run: ``pytest tests/unit/sandbox -m namespace -q`` (skipped where bwrap cannot run).
"""

from __future__ import annotations

import os

import pytest

from testkit.sandbox_testutil import NEEDS_NS
from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import SandboxUnavailable, make_sandbox
from opencomposer.sandbox.namespace import NamespaceSandbox

pytestmark = NEEDS_NS


@pytest.fixture
def ns(base_repo, venv_dir, tmp_path):
    with make_sandbox(SandboxSpec(base_dir=base_repo, env_dir=venv_dir), backend="namespace", root=tmp_path) as sb:
        yield sb


def test_no_network(ns):
    r = ns.exec("python -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), timeout=3)'", timeout=10)
    assert r.exit_code != 0 and "unreachable" in r.output.lower(), r.output
    assert ns.exec("getent hosts example.com", timeout=10).exit_code != 0


def test_loopback_works_offline(ns):
    # Tests that start a local server must still run without network.
    code = "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); print('ok')"
    assert ns.exec(f'python -c "{code}"').output.strip() == "ok"


def test_secrets_and_host_dirs_are_hidden(ns, venv_dir):
    assert ns.exec("cat /etc/shadow").exit_code != 0
    assert ns.exec("test -e /etc/shadow").exit_code == 1
    hidden = [f"/root/{n}" for n in os.listdir("/root") if n != ".pyenv"] + ["/home", "/work", "/var", "/opt"]
    visible = ns.exec("for p in " + " ".join(hidden) + '; do test -e "$p" && echo "$p"; done; true').output
    assert visible == "", f"host paths visible inside: {visible}"
    # Only the venv itself shows up from the host's /tmp, plus the private HOME.
    assert ns.exec("ls -A /tmp").output.split() == sorted(["home", str(venv_dir).split("/")[2]])


def test_system_is_read_only_and_capabilities_dropped(ns):
    assert ns.exec("touch /usr/oc_probe").exit_code != 0
    assert not os.path.exists("/usr/oc_probe")
    assert ns.exec(f"touch {ns.spec.env_dir}/oc_probe").exit_code != 0
    assert ns.exec("grep CapEff /proc/self/status").output.split()[1] == "0" * 16
    assert ns.exec("mount -t tmpfs none /usr").exit_code != 0


def test_own_pid_namespace(ns):
    # Only bwrap's init, the shell and ls itself: the host's processes are invisible.
    pids = ns.exec("ls /proc | grep -c '^[0-9]'").output.strip()
    assert int(pids) <= 4


def test_tmp_is_private_per_exec(ns):
    ns.exec("echo x > /tmp/scratch")
    assert ns.exec("test -e /tmp/scratch").exit_code == 1


def test_missing_bwrap_is_a_clear_error(base_repo):
    with pytest.raises(SandboxUnavailable, match="/nonexistent/bwrap"):
        NamespaceSandbox(SandboxSpec(base_dir=base_repo), bwrap="/nonexistent/bwrap")


def test_missing_env_dir_names_it_and_leaves_nothing(base_repo, tmp_path):
    root = tmp_path / "sbx"
    root.mkdir()
    with pytest.raises(FileNotFoundError, match="no-such-env"):
        NamespaceSandbox(SandboxSpec(base_dir=base_repo, env_dir=tmp_path / "no-such-env"), root=root)
    assert list(root.iterdir()) == []


def test_base_interpreter_packages_are_hidden(ns):
    # The venv's base Python is bound read-only so it can run, but its site-packages may
    # hold the task's library (or a vendored copy, as setuptools vendors more_itertools).
    import sys
    import sysconfig
    site = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["purelib"]
    assert os.listdir(site), "the host's site-packages is not empty (test precondition)"
    assert ns.exec(f"ls -A {site}").output.strip() == ""
    assert ns.exec("python -c 'import sys; print(sys.version_info[0])'").output.strip() == "3"


def test_one_exec_server_per_sandbox_and_threads_take_turns(ns):
    import threading

    ns.exec("true")
    server = ns._server.proc.pid
    out: list[str] = []
    threads = [threading.Thread(target=lambda i=i: out.append(ns.exec(f"sleep 0.2; echo {i}").output)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(out) == ["0\n", "1\n", "2\n"]
    assert ns._server.proc.pid == server  # the same server ran all of them
    assert ns.exec("echo $$").output.strip() != "1"  # commands are its children, not PID 1


def test_a_dead_exec_server_is_reported_and_replaced(ns):
    ns.exec("true")
    bwrap = ns._server.proc.pid
    server = int(open(f"/proc/{bwrap}/task/{bwrap}/children").read().split()[0])
    os.kill(server, 9)  # as the OOM killer might
    r = ns.exec("echo lost")
    assert r.exit_code == 137 and "exec server died" in r.output, r.output
    assert ns.exec("echo back").output == "back\n"  # a fresh server, same files
    assert ns._server.proc.pid != bwrap


def test_no_timeout_means_wait_for_the_command(base_repo, tmp_path):
    from opencomposer.protocols import SandboxLimits

    # timeout=0 and no disk watch (disk_mb=0): the host waits on the server with no deadline at all.
    with NamespaceSandbox(SandboxSpec(base_dir=base_repo, limits=SandboxLimits(disk_mb=0)), root=tmp_path) as sb:
        r = sb.exec("sleep 0.3; echo done", timeout=0)
        assert r.output == "done\n" and not r.timed_out


def test_works_with_host_fds_past_1024(base_repo, tmp_path):
    # Hundreds of live sandboxes put their pipes past fd 1024, where select() fails.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        with NamespaceSandbox(SandboxSpec(base_dir=base_repo), root=tmp_path) as sb:
            assert sb.exec("echo high").output == "high\n"
            assert sb._server.out > 1024
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
