"""Per-sandbox limits on real namespace sandboxes, under each mechanism this host offers.

``cgroup`` cases run where a writable cgroup hierarchy exists (root here); ``rlimit``
cases force rlimits alone (``OPENCOMPOSER_CGROUP=off``), as an unprivileged host has.

Run: ``pytest tests/unit/sandbox/test_limits.py -q``.
"""

from __future__ import annotations

import os

import pytest

from testkit.sandbox_testutil import NEEDS_NS
from opencomposer.protocols import SandboxLimits, SandboxSpec
from opencomposer.sandbox import limits as limits_mod
from opencomposer.sandbox.limits import Limiter, cgroup_host, tree_bytes
from opencomposer.sandbox.namespace import NamespaceSandbox

pytestmark = NEEDS_NS
SMALL = SandboxLimits(memory_mb=128, processes=48, cpu_seconds=1, disk_mb=24, open_files=64)
HAS_CGROUP = cgroup_host() is not None


@pytest.fixture(params=[pytest.param("cgroup", marks=pytest.mark.skipif(not HAS_CGROUP, reason="no writable cgroup")),
                        "rlimit"])
def mech(request, monkeypatch):
    if request.param == "rlimit":
        monkeypatch.setenv(limits_mod.CGROUP_ENV, "off")
    cgroup_host.cache_clear()
    yield request.param
    monkeypatch.undo()
    cgroup_host.cache_clear()


@pytest.fixture
def small(mech, base_repo, tmp_path):
    with NamespaceSandbox(SandboxSpec(base_dir=base_repo, limits=SMALL), root=tmp_path) as sb:
        assert bool(sb._limiter.cgroups) == (mech == "cgroup")
        yield sb


def test_mechanism_is_reported(mech):
    assert limits_mod.mechanism() == ("rlimit" if mech == "rlimit" else f"cgroup-v{cgroup_host().version}+rlimit")


def test_memory_bomb(small, mech):
    r = small.exec("python3 -c 'x = bytearray(1 << 30); print(len(x))'", timeout=20)
    assert r.exit_code != 0 and "1073741824" not in r.output
    if mech == "cgroup":
        assert r.output.endswith("[killed: memory limit 128 MiB exceeded]"), r.output
    else:
        assert "MemoryError" in r.output and "[memory limit 128 MiB per process reached" in r.output, r.output
    # Memory grown slowly (no single large allocation) is caught as well.
    r = small.exec("python3 -c '\nl = []\nwhile True: l.append(bytearray(8 << 20))'", timeout=20)
    assert r.exit_code != 0 and "memory limit 128 MiB" in r.output, r.output
    assert small.exec("echo alive").output == "alive\n"


def test_cpu_spin(small):
    r = small.exec("while :; do :; done", timeout=30)
    assert not r.timed_out and r.exit_code == 128 + 24, r.output
    assert r.output.endswith("[killed: CPU time limit 1 s exceeded]")


def test_file_size_and_disk(small):
    r = small.exec("dd if=/dev/zero of=big bs=1M count=100", timeout=30)
    assert r.output.endswith("[killed: file size limit 24 MiB exceeded]"), r.output
    small.exec("rm -f big")
    # /tmp is a tmpfs of the same size.
    r = small.exec("head -c 40000000 /dev/zero > /tmp/x; echo rc=$?")
    assert "rc=0" not in r.output


@pytest.mark.parametrize("disk", ["tmpfs", "watched"])
def test_disk_limit_over_many_files(disk, base_repo, tmp_path, monkeypatch):
    # Many files each under the per-file cap. "tmpfs": the changes live on a tmpfs of
    # disk_mb (hosts that can mount, as root): writes past it fail, no overshoot.
    # "watched": a host that cannot mount (the mount is refused, as for non-root): the
    # workspace's growth is watched and the command killed, a little past the limit.
    from opencomposer.sandbox import cleanup

    if disk == "watched":
        monkeypatch.setattr(cleanup, "mount_disk", lambda root, nbytes: None)
    with NamespaceSandbox(SandboxSpec(base_dir=base_repo, limits=SMALL), root=tmp_path) as sb:
        if disk == "tmpfs" and not sb.disk_hard:
            pytest.skip("this host cannot mount a tmpfs (not root)")
        r = sb.exec("for i in $(seq 40); do head -c 8388608 /dev/zero > f$i; done; sleep 5", timeout=30)
        used = tree_bytes(sb._upper)
        if disk == "tmpfs":
            assert "No space left on device" in r.output and "[disk limit 24 MiB reached: writes fail" in r.output, r.output
            assert used <= 24 << 20
        else:
            assert "[killed: disk limit 24 MiB exceeded" in r.output and not r.timed_out, r.output
        assert sb.exec("rm -f f* && echo freed").output == "freed\n"
        assert tree_bytes(sb._upper) < 24 << 20
        assert sb.exec("echo more > g && cat g").output == "more\n"  # writable again


def test_open_files(small):
    r = small.exec("python3 -c 'fs = [open(\"/dev/null\") for _ in range(200)]'")
    assert r.exit_code != 0 and "Too many open files" in r.output


def test_process_limit(small, mech):
    if mech == "rlimit" and os.getuid() == 0:
        pytest.skip("RLIMIT_NPROC is never enforced for host root: processes are capped by the cgroup only")
    r = small.exec("for i in $(seq 100); do sleep 1 & done; wait", timeout=20)
    assert "[process limit 48 reached: new processes were refused]" in r.output, r.output
    assert small.exec("echo alive").output == "alive\n"


def test_limits_off_means_no_cap(base_repo, tmp_path):
    off = SandboxLimits(memory_mb=0, processes=0, cpu_seconds=0, disk_mb=0, open_files=0)
    lim = Limiter(off, "x", host=None)
    assert [res for res, *_ in lim.rlimits()] == [__import__("resource").RLIMIT_CORE]
    with NamespaceSandbox(SandboxSpec(base_dir=base_repo, limits=off), root=tmp_path) as sb:
        assert sb.exec("python3 -c 'x = bytearray(300 << 20); print(len(x) >> 20)'").output == "300\n"


def test_cgroups_go_with_the_sandbox(base_repo, tmp_path):
    if not HAS_CGROUP:
        pytest.skip("no writable cgroup")
    sb = NamespaceSandbox(SandboxSpec(base_dir=base_repo, limits=SMALL), root=tmp_path)
    dirs = sb._limiter.cgroup_dirs()
    assert dirs and all(os.path.isdir(d) for d in dirs)
    assert open(os.path.join(sb._limiter.cgroups["pids"], "pids.max")).read().strip() == "48"
    sb.close()
    assert not any(os.path.exists(d) for d in dirs)


def test_server_sets_the_limits_every_command_inherits(small):
    assert small.exec("ulimit -n; ulimit -t; ulimit -c").output.split() == ["64", "1", "0"]
    # A command cannot raise them (hard limits; no CAP_SYS_RESOURCE inside).
    assert small.exec("ulimit -t 100").exit_code != 0


def test_server_is_recycled_before_its_own_cpu_allowance_runs_out(small):
    # cpu_seconds=1: the server has used 0.5 s of CPU after a few hundred commands; it
    # then says so, exits, and the next command starts a fresh one without a visible seam.
    first = small._server_ready().proc.pid
    for _ in range(2000):
        assert small.exec(["true"]).exit_code == 0
        if small._server is None or small._server.dead:
            break
    assert small._server is None or small._server.dead or small._server.proc.pid != first
    assert small.exec("echo alive").output == "alive\n"
