"""Remote sandboxes on a real local Ray cluster (2 CPUs): the Sandbox protocol over actors.

Run: ``pytest tests/integration/test_ray_sandboxes.py -q`` (~10-15 s, most of it Ray start).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from pathlib import Path

import pytest

from opencomposer.protocols import PathEscape, Sandbox, SandboxSpec

ray = pytest.importorskip("ray", reason="ray is not installed (pip install ray)")

from opencomposer.sandbox import make_sandbox  # noqa: E402
from opencomposer.sandbox.pool import SandboxPool  # noqa: E402
from opencomposer.sandbox.cluster import SandboxCluster  # noqa: E402
from opencomposer.sandbox.remote import RemoteSandbox  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "README.md").write_text("# demo\n")
    (root / "pkg" / "mod.py").write_text("def add(a, b):\n    return a + b\n")
    return root


def _start(tmp: Path, hosts: int) -> SandboxCluster:
    sbx = tmp / "sbx"
    sbx.mkdir()
    c = SandboxCluster.start(hosts=hosts, backend="local", root=str(sbx))
    c.root = sbx
    return c


@pytest.fixture(scope="module")
def cluster(ray_local, tmp_path_factory):
    c = _start(tmp_path_factory.mktemp("ray"), hosts=2)  # actors take seconds to start: shared
    yield c
    if c.hosts:
        c.shutdown()


def test_protocol_over_an_actor(cluster, repo):
    with cluster.sandbox(SandboxSpec(base_dir=repo, pythonpath=["pkg"])) as sb:
        assert isinstance(sb, Sandbox) and sb.backend == "remote"
        r = sb.exec("python3 -c 'import mod; print(mod.add(2, 3))'; exit 4")
        assert r.exit_code == 4 and r.output == "5\n" and not r.timed_out
        assert sb.exec("cat", stdin=b"piped").output == "piped"
        assert sb.exec("pwd", cwd="pkg").output.strip() == f"{sb.workdir}/pkg"
        sid = sb.snapshot()
        sb.write_file("pkg/new.py", b"X = 1\n")
        assert sb.read_file("pkg/new.py") == b"X = 1\n"
        child = sb.fork()  # on the same host, from the current files
        sb.restore(sid)
        assert sb.exec("test -e pkg/new.py || echo gone").output == "gone\n"
        assert child.read_file("pkg/new.py") == b"X = 1\n"
        child.write_file("README.md", b"changed\n")
        child.reset()  # back to where it was forked, not to the base image
        assert child.read_file("README.md") == b"# demo\n" and child.read_file("pkg/new.py") == b"X = 1\n"
        child.close()
        # errors raised on the host keep their type on the client
        with pytest.raises(PathEscape):
            sb.read_file("../../etc/passwd")
        with pytest.raises(FileNotFoundError):
            sb.read_file("missing.txt")
        with pytest.raises(KeyError, match="unknown snapshot"):
            sb.restore("s999")
        assert sb.exec("sleep 30", timeout=1).timed_out
    with pytest.raises(RuntimeError, match="closed"):
        sb.exec("true")


def test_sandboxes_spread_over_hosts_and_run_in_parallel(cluster, repo):
    spec = SandboxSpec(base_dir=repo)
    boxes = [cluster.sandbox(spec) for _ in range(4)]
    hosts = [h["sandboxes"] for h in cluster.info()]
    assert hosts == [2, 2]  # least-loaded placement
    assert len({h["pid"] for h in cluster.info()}) == 2  # two actor processes
    t = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda sb: sb.exec("sleep 2; echo done").output, boxes))
    took = time.monotonic() - t
    assert outs == ["done\n"] * 4
    # 2 sandboxes per host: ~2 s if a host runs them at once, >= 4 s if it serialises them
    assert took < 3.5, f"4 x 2 s sleeps on 2 threaded hosts took {took:.2f} s (serialised?)"
    for sb in boxes:
        sb.close()
    assert [h["sandboxes"] for h in cluster.info()] == [0, 0]
    assert list(cluster.root.iterdir()) == []


def test_make_sandbox_remote_pool_and_shutdown_cleanup(ray_local, repo, tmp_path):
    cluster = _start(tmp_path, hosts=1)
    spec = SandboxSpec(base_dir=repo)
    sb = make_sandbox(spec, backend="remote", host=cluster.hosts[0])
    assert isinstance(sb, RemoteSandbox) and sb.read_file("README.md") == b"# demo\n"
    with pytest.raises(ValueError, match="needs host="):
        make_sandbox(spec, backend="remote")

    async def pooled():  # the pool hands out remote sandboxes just the same
        async with SandboxPool(factory=cluster.sandbox, warm=0, max_sandboxes=2) as pool:
            async with pool.acquire(spec) as rsb:
                await asyncio.to_thread(rsb.write_file, "x.txt", b"1")
            async with pool.acquire(spec) as again:
                assert again is rsb and (await asyncio.to_thread(again.exec, "ls")).output.split() == ["README.md", "pkg"]

    asyncio.run(pooled())
    assert cluster.shutdown() == 1  # the one made with make_sandbox, still open
    assert list(cluster.root.iterdir()) == []
    sb.close()  # host gone: closing the client is still safe


def test_unknown_backend_fails_at_start(ray_local):
    with pytest.raises(ValueError, match="unknown sandbox backend 'nope'"):
        SandboxCluster.start(hosts=1, backend="nope")
