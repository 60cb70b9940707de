"""The adversarial suite: what a hostile (or merely careless) agent tries, on real sandboxes
of each isolating backend: ``namespace`` (bwrap), and ``gvisor`` where runsc runs (skipped,
saying why, elsewhere). Where gVisor holds less (no cgroup: memory per process only, no
CPU-time limit in Debian 12's runsc), the case says so and checks what does hold.

Each case checks four things: the attack is contained, the agent gets a clear
observation, the host and a neighbouring sandbox are unaffected, and the sandbox still
works and closes. Cases shared with every backend (1 GB of stdout, a command that
outlives its timeout, background daemons, ``..``/symlink paths in the file API) live in
``test_sandbox_common.py``; limits one by one in ``test_limits.py``.

Run: ``pytest tests/unit/sandbox/test_adversarial.py -q`` (needs bwrap / runsc; cgroup
cases need a writable cgroup hierarchy, as root has).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from testkit.sandbox_testutil import NEEDS_NS, ppid, wait_gone
from opencomposer.config import AgentConfig
from opencomposer.protocols import SandboxLimits, SandboxSpec, ToolCall
from opencomposer.sandbox import make_sandbox
from opencomposer.sandbox.gvisor import unavailable_reason as gvisor_reason
from opencomposer.sandbox.limits import cgroup_host

GVISOR_REASON = gvisor_reason()
BACKENDS = [pytest.param("namespace", marks=NEEDS_NS),
            pytest.param("gvisor", marks=pytest.mark.skipif(GVISOR_REASON is not None, reason=f"gvisor: {GVISOR_REASON}"))]
LIMITS = SandboxLimits(memory_mb=256, processes=64, cpu_seconds=2, disk_mb=32, open_files=256)


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def pair(backend, base_repo, venv_dir, tmp_path):
    """The sandbox under attack, and a neighbour that must not notice."""
    spec = SandboxSpec(base_dir=base_repo, env_dir=venv_dir, limits=LIMITS)
    a, b = make_sandbox(spec, backend, root=tmp_path), make_sandbox(spec, backend, root=tmp_path)
    b.write_file("neighbour.txt", b"mine")
    yield a, b
    for sb in (a, b):
        sb.close()
        assert not sb._root.exists()
    assert not any(os.path.exists(d) for sb in (a, b) for d in sb._limiter.planned_cgroups())


def files_of(sb) -> Path:
    """Where a sandbox's workspace changes live on the host (overlay upper, or gVisor's copy)."""
    return sb._upper if sb.backend == "namespace" else sb._ws


def unaffected(a, b) -> None:
    """The attacked sandbox still runs commands; the neighbour and the host are intact."""
    assert a.exec("echo alive").output == "alive\n"
    assert b.exec("cat neighbour.txt").output == "mine"
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork
    cg = a._limiter.cgroups.get("pids")
    if cg:  # nothing of the attack is still running inside: only bwrap and the exec server (its child)
        bwrap = a._server.proc.pid
        left = [p for p in map(int, Path(cg, "cgroup.procs").read_text().split()) if bwrap not in (p, ppid(p))]
        assert left == []


def test_fork_bomb(pair):
    a, b = pair
    if a.backend == "namespace" and cgroup_host() is None and os.getuid() == 0:
        pytest.skip("host root without a writable cgroup: nothing caps processes")
    t = time.monotonic()
    r = a.exec("bomb() { bomb | bomb & }; bomb; sleep 2", timeout=4)
    assert time.monotonic() - t < 10
    assert "[process limit 64 reached: new processes were refused]" in r.output, r.output[-500:]
    unaffected(a, b)


def test_memory_bomb_in_many_processes(pair):
    a, b = pair
    # Eight processes of 64 MiB each: none alone is over 256 MiB, together they are.
    code = "import time; x = bytearray(64 << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep(3)"
    r = a.exec(f"for i in 1 2 3 4 5 6 7 8; do python -c \"{code}\" & done; wait", timeout=20)
    if a.backend == "namespace" and cgroup_host() is not None:
        assert "[killed: memory limit 256 MiB exceeded]" in r.output, r.output[-500:]
    # gvisor: no cgroup, so memory is capped per process (RLIMIT_AS) only; 8 x 64 MiB runs.
    unaffected(a, b)


def test_cpu_spin_in_background_is_killed_with_the_command(pair):
    a, b = pair
    r = a.exec("(while :; do :; done) & (while :; do :; done) & sleep 1; echo spun", timeout=10)
    assert r.output.startswith("spun")
    assert not wait_gone("while :; do :; done", 1.0)
    unaffected(a, b)


def test_disk_fill(pair):
    a, b = pair
    r = a.exec("i=0; while :; do i=$((i+1)); head -c 4194304 /dev/zero > fill$i || break; done", timeout=30)
    # namespace as root: a tmpfs of 32 MiB, writes fail ("reached"); gvisor / non-root: watched, killed ("exceeded").
    assert "disk limit 32 MiB" in r.output and not r.timed_out, r.output[-300:]
    assert a.exec("rm -f fill* && echo ok").output == "ok\n"
    unaffected(a, b)


def test_network_egress_tcp_udp_dns(pair):
    a, b = pair
    # Host listeners on loopback: the sandbox's own loopback is another one, so nothing arrives.
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.5)
    try:
        r = a.exec(f"python -c 'import socket; socket.create_connection((\"127.0.0.1\", {tcp.getsockname()[1]}), timeout=2)'")
        assert r.exit_code != 0 and "Connection refused" in r.output, r.output
        a.exec(f"python -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b\"leak\", (\"127.0.0.1\", {udp.getsockname()[1]}))'")
        with pytest.raises(socket.timeout):
            udp.recvfrom(16)
    finally:
        tcp.close()
        udp.close()
    r = a.exec("getent hosts pypi.org; echo rc=$?", timeout=10)
    assert "rc=2" in r.output or "rc=1" in r.output, r.output
    # Only a loopback interface exists, and it has no route out.
    ifaces = [ln.split(":")[0].strip() for ln in a.exec("cat /proc/net/dev").output.splitlines()[2:]]
    assert ifaces == ["lo"]
    unaffected(a, b)


def test_host_files_and_other_sandboxes_are_invisible(pair):
    a, b = pair
    home_file = Path(os.path.expanduser("~"), f".oc_probe_{os.getpid()}")
    home_file.write_text("host home")
    probes = ["/etc/shadow", str(home_file), str(b._root), str(files_of(b) / "neighbour.txt"),
              str(Path(__file__).resolve()), "/proc/1/root/etc/shadow"]
    if a.backend == "namespace":  # gVisor's /sys is its own kernel's, made up by the Sentry
        probes.append("/sys/kernel")
    try:
        r = a.exec("for p in " + " ".join(probes) + '; do test -e "$p" && echo "visible: $p"; done; echo done')
    finally:
        home_file.unlink()
    assert r.output == "done\n", r.output
    assert a.exec("cat /etc/shadow").exit_code != 0
    unaffected(a, b)


def test_writes_outside_the_workspace_fail(pair):
    a, b = pair
    env = a.spec.env_dir
    r = a.exec(f"for p in /oc_x /usr/oc_x /etc/oc_x /bin/oc_x {env}/oc_x /proc/oc_x; do "
               'touch "$p" 2>/dev/null && echo "wrote $p"; done; echo done')
    assert r.output == "done\n", r.output
    assert not any(os.path.exists(p) for p in ("/oc_x", "/usr/oc_x", "/etc/oc_x", f"{env}/oc_x"))
    unaffected(a, b)


def test_escapes_through_the_shell(pair):
    a, b = pair
    r = a.exec("ln -s / rootlink; ln -s /usr/bin binlink; cat rootlink/etc/shadow; "
               "echo x > binlink/oc_evil; cd ../../..; pwd; cat etc/shadow; echo rc=$?")
    assert "Read-only file system" in r.output and "rc=1" in r.output, r.output
    assert not os.path.exists("/usr/bin/oc_evil")
    unaffected(a, b)


def test_escapes_through_the_agent_tools(pair, tmp_path):
    from opencomposer.harness.tools import execute

    a, b = pair
    secret = tmp_path / "host_secret.txt"
    secret.write_text("host secret")
    a.exec(f"ln -s {secret} s; ln -s {files_of(b)} nb; ln -s /etc e; ln -s .. up")
    cfg = AgentConfig()
    calls = [("read_file", {"path": "s"}), ("read_file", {"path": "nb/neighbour.txt"}),
             ("read_file", {"path": "../../etc/passwd"}), ("read_file", {"path": "e/passwd"}),
             ("write_file", {"path": "e/oc_evil", "content": "x"}), ("write_file", {"path": "/tmp/x", "content": "x"}),
             ("edit_file", {"path": "up/README.md", "old": "a", "new": "b"}), ("list_dir", {"path": "../"}),
             ("search", {"pattern": "secret", "path": "../.."})]
    for name, args in calls:
        out = execute(a, ToolCall(name, args), cfg)
        assert not out.ok and out.observation.startswith("Error:"), (name, args, out.observation)
        assert "host secret" not in out.observation and "mine" not in out.observation
    assert secret.read_text() == "host secret" and not os.path.exists("/etc/oc_evil")
    unaffected(a, b)


def test_proc_and_sys_tricks(pair):
    a, b = pair
    r = a.exec("echo 1 > /proc/sys/kernel/sysrq; echo rc=$?; echo b > /proc/sysrq-trigger; echo rc=$?; "
               "mount -t proc proc /mnt 2>&1; echo rc=$?; ls /proc | grep -c '^[0-9]'")
    lines = r.output.splitlines()
    assert [ln for ln in lines if ln.startswith("rc=")] == ["rc=1", "rc=1", "rc=1"] or "rc=0" not in r.output, r.output
    assert int(lines[-1]) <= 5  # only the sandbox's own processes
    # unshare/nested user namespaces are off, so the sandbox cannot regain capabilities.
    if a.backend == "namespace":
        assert a.exec("unshare -U true").exit_code != 0
    else:  # gVisor allows it, inside its own kernel: the new namespace's root still cannot write the system
        r = a.exec("unshare -Ur sh -c 'touch /usr/oc_x; mount -t tmpfs none /usr && echo mounted'; echo done")
        assert "mounted" not in r.output and not os.path.exists("/usr/oc_x"), r.output
    unaffected(a, b)


def test_signals_to_the_parent(pair):
    a, b = pair
    r = a.exec(f"kill -9 {os.getpid()}; echo host=$?; kill -9 {os.getppid()}; kill -9 -1; echo after")
    assert "No such process" in r.output, r.output
    assert os.getpid()  # still here
    unaffected(a, b)


def test_the_exec_server_cannot_be_traced_or_written(pair):
    """The exec server (PID 1 inside) is not dumpable: a command cannot ptrace it, nor open its
    memory, environment or descriptors (without the fix, PTRACE_ATTACH stopped and killed it)."""
    a, b = pair
    if a.backend != "namespace":
        pytest.skip("gVisor runs no exec server of ours inside the sandbox")
    r = a.exec("python3 -c \"import ctypes; l = ctypes.CDLL(None, use_errno=True); "
               "print('ptrace', l.ptrace(16, 1, 0, 0), ctypes.get_errno())\"; "
               "for f in mem environ fd/0 fd/1; do python3 -c \"open('/proc/1/$f', 'r+b')\" 2>&1 | tail -1; done; "
               "ls -l /proc/self/fd | grep -c pipe")
    assert "ptrace -1 1" in r.output, r.output  # EPERM
    assert r.output.count("PermissionError: [Errno 13]") == 4, r.output
    assert r.output.splitlines()[-1] == "2", r.output  # the command's own stdout/stderr pipe: no server pipe inherited
    unaffected(a, b)


def test_setuid_attempts(pair):
    a, b = pair
    r = a.exec("grep NoNewPrivs /proc/self/status; python -c 'import os; os.setuid(1000)'; "
               "cp /bin/sh ./rootsh && chmod u+s ./rootsh && ./rootsh -c 'grep CapEff /proc/self/status'")
    # setuid to another uid: EPERM without CAP_SETUID, EINVAL as no other uid is mapped.
    assert "PermissionError" in r.output or "Invalid argument" in r.output, r.output
    if a.backend == "namespace":  # gVisor's /proc/self/status has no NoNewPrivs line (the OCI config sets it)
        assert "NoNewPrivs:\t1" in r.output, r.output
    assert "CapEff:\t0000000000000000" in r.output
    unaffected(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_while_a_command_runs(backend, base_repo, tmp_path):
    import threading

    sb = make_sandbox(SandboxSpec(base_dir=base_repo, limits=LIMITS), backend, root=tmp_path)
    token = f"{os.getpid() % 1000 + 93000}"
    th = threading.Thread(target=sb.exec, args=(f"sleep {token}",), kwargs={"timeout": 60})
    th.start()
    end = time.monotonic() + 5
    while not wait_gone(f"sleep {token}", 0) and time.monotonic() < end:
        time.sleep(0.05)
    sb.close()
    th.join(10)
    assert not th.is_alive() and not wait_gone(f"sleep {token}") and not sb._root.exists()
