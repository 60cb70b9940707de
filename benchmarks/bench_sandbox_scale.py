"""Sandboxes at scale: pool acquire (cold vs warm), fork_many, Ray remote exec, gVisor memory snapshots.

On a synthetic repo of ``--files`` small files (``bench_sandbox.synthetic_repo``):

- ``pool``: ``SandboxPool.acquire`` latency with an empty pool (creates) vs a warm one
  (health check only), per backend;
- ``fork8``: ``fork_many(sb, 8)`` wall time, after editing 10 files, per backend;
- ``remote``: ``exec("true")`` p50 directly vs through a Ray actor (``--ray``; starts a
  2-CPU local Ray, reports its start time);
- ``gvisor_ckpt``: checkpoint / restore-into-a-new-sandbox of a running Python process.

Lifecycle latency per backend (create, exec, snapshot, ...) is ``bench_sandbox.py
--backends local,namespace,gvisor,docker``. Prints a table, then one JSON line.

Run: ``.venv/bin/python benchmarks/bench_sandbox_scale.py --n 20 --backends local,namespace,gvisor [--ray]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sandbox import synthetic_repo  # noqa: E402

from opencomposer.protocols import SandboxSpec  # noqa: E402
from opencomposer.sandbox import SandboxUnavailable, make_sandbox  # noqa: E402
from opencomposer.sandbox.branch import fork_many  # noqa: E402
from opencomposer.sandbox.pool import SandboxPool  # noqa: E402


def ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 2)


def bench_pool(spec: SandboxSpec, backend: str, n: int, root: Path) -> dict:
    async def main():
        cold, warm = [], []
        async with SandboxPool(backend, warm=0, max_sandboxes=n + 1, root=root) as pool:
            async with contextlib.AsyncExitStack() as held:
                for _ in range(n):  # each acquire while the previous is held: always a new one
                    t = time.perf_counter()
                    await held.enter_async_context(pool.acquire(spec))
                    cold.append(time.perf_counter() - t)
        async with SandboxPool(backend, warm=2, max_sandboxes=4, root=root) as pool:
            await pool.prewarm(spec)
            for _ in range(n):
                t = time.perf_counter()
                async with pool.acquire(spec):
                    warm.append(time.perf_counter() - t)
        return {"acquire_cold_ms": ms(cold), "acquire_warm_ms": ms(warm)}

    return asyncio.run(main())


def bench_fork(spec: SandboxSpec, backend: str, root: Path) -> dict:
    with make_sandbox(spec, backend, root=root) as sb:
        sb.exec("for f in $(find . -name '*.py' | head -10); do echo '# edit' >> $f; done")
        t = time.perf_counter()
        kids = fork_many(sb, 8)
        took = time.perf_counter() - t
        for k in kids:
            k.close()
    return {"fork8_ms": round(took * 1000, 1)}


def bench_remote(spec: SandboxSpec, backend: str, n: int, root: Path) -> dict:
    import ray

    from opencomposer.sandbox.cluster import SandboxCluster

    t = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray_start = time.perf_counter() - t
    try:
        t = time.perf_counter()
        cluster = SandboxCluster.start(hosts=1, backend=backend, root=str(root))
        host_start = time.perf_counter() - t
        direct, remote = [], []
        with make_sandbox(spec, backend, root=root) as sb, cluster.sandbox(spec) as rsb:
            for _ in range(n):
                t = time.perf_counter()
                sb.exec("true")
                direct.append(time.perf_counter() - t)
                t = time.perf_counter()
                rsb.exec("true")
                remote.append(time.perf_counter() - t)
        cluster.shutdown()
    finally:
        ray.shutdown()
    return {"ray_init_s": round(ray_start, 2), "host_start_s": round(host_start, 2),
            "exec_direct_ms": ms(direct), "exec_remote_ms": ms(remote)}


def bench_gvisor_ckpt(spec: SandboxSpec, root: Path) -> dict:
    from opencomposer.sandbox.gvisor import GVisorSandbox

    code = "import time\nx = bytearray(32 << 20)\nn = 0\nwhile True:\n    n += 1\n    print(n, flush=True)\n    time.sleep(0.05)\n"
    with GVisorSandbox(spec, root=root) as sb:
        svc = sb.start(["python3", "-c", code])
        time.sleep(1.0)
        t = time.perf_counter()
        snap = sb.checkpoint(svc, leave_running=False)
        ckpt = time.perf_counter() - t
        size = sum(f.stat().st_size for f in snap.image_dir.iterdir())
        t = time.perf_counter()
        child, _ = sb.restore_checkpoint(snap)
        restore = time.perf_counter() - t
        child.close()
    return {"checkpoint_s": round(ckpt, 2), "restore_new_sandbox_s": round(restore, 2), "image_mb": round(size / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--backends", default="local,namespace")
    ap.add_argument("--ray", action="store_true", help="also measure remote exec through a local Ray actor")
    args = ap.parse_args()
    results: dict = {"machine": f"{platform.node()} {os.cpu_count()} cpu", "loadavg": open("/proc/loadavg").read().split()[:3]}
    with tempfile.TemporaryDirectory(prefix="oc-bench-scale-") as tmp:
        repo = synthetic_repo(Path(tmp) / "repo", args.files)
        spec = SandboxSpec(base_dir=repo)
        root = Path(tmp) / "sbx"
        root.mkdir()
        for backend in args.backends.split(","):
            try:
                r = bench_pool(spec, backend, args.n, root)
                r.update(bench_fork(spec, backend, root))
                if args.ray:
                    r.update(bench_remote(spec, backend, args.n, root))
                if backend == "gvisor":
                    r.update(bench_gvisor_ckpt(spec, root))
            except SandboxUnavailable as e:
                r = {"unavailable": str(e)[:200]}
            results[backend] = r
            print(f"{backend:<10} " + "  ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
