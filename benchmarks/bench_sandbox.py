"""Latency of the sandbox lifecycle, per backend: create, exec, file I/O, snapshot, restore, reset, close.

Builds a synthetic repo of ``--files`` small files (default 2,000, in 40 dirs), and
optionally also uses a real directory (``--real-dir``), then runs ``--n`` iterations of

    create -> exec("true") -> write_file -> read_file -> snapshot -> (edit) -> restore
           -> reset -> close

timing each step. Prints a table (p50/p99/mean in ms; p99 is nearest-rank, so with
n < 100 it is the maximum) and then one JSON line with every number, for RESULTS.md.

Copies dominate the local backend, so disk speed matters: ``--root /dev/shm`` puts the
sandbox dirs on tmpfs (the base repo stays in the temp dir either way).

Run: ``.venv/bin/python benchmarks/bench_sandbox.py --n 50 [--root /dev/shm]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import SandboxUnavailable, make_sandbox

STEPS = ("create", "exec_true", "write_file", "read_file", "snapshot", "restore", "reset", "close")


def synthetic_repo(root: Path, files: int, dirs: int = 40) -> Path:
    """``files`` small Python-ish files spread over ``dirs`` packages, plus a README."""
    for i in range(files):
        d = root / f"pkg{i % dirs:02d}"
        d.mkdir(parents=True, exist_ok=True)
        body = "".join(f"def f{j}(x):\n    return x + {i * j}\n\n" for j in range(1 + i % 20))
        (d / f"mod{i:04d}.py").write_text(body)
    (root / "README.md").write_text("# synthetic\n")
    return root


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def bench(spec: SandboxSpec, backend: str, n: int, root: Path) -> dict[str, dict[str, float]]:
    times: dict[str, list[float]] = {s: [] for s in STEPS}

    def timed(step, fn, *args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        times[step].append((time.perf_counter() - t) * 1000)
        return out

    for _ in range(n):
        sb = timed("create", make_sandbox, spec, backend, root=root)
        r = timed("exec_true", sb.exec, "true")
        assert r.exit_code == 0, r.output
        timed("write_file", sb.write_file, "bench/new.txt", b"hello\n")
        timed("read_file", sb.read_file, "README.md")
        sid = timed("snapshot", sb.snapshot)
        # Diverge from the snapshot the way an agent would: edit, delete, create.
        sb.exec("echo '# edit' >> README.md && rm -rf pkg00 && mkdir -p extra && echo x > extra/y")
        timed("restore", sb.restore, sid)
        timed("reset", sb.reset)
        timed("close", sb.close)
    return {
        s: {"p50_ms": statistics.median(v), "p99_ms": percentile(v, 0.99), "mean_ms": statistics.fmean(v)}
        for s, v in times.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20, help="iterations per backend and repo")
    ap.add_argument("--files", type=int, default=2000, help="files in the synthetic repo")
    ap.add_argument("--real-dir", type=Path, default=None, help="also benchmark on this directory")
    ap.add_argument("--backends", default="local,namespace")
    ap.add_argument("--root", type=Path, default=None,
                    help="where sandbox dirs go (default: the benchmark's temp dir; try /dev/shm)")
    args = ap.parse_args()

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="oc-bench-") as tmp, tempfile.TemporaryDirectory(
        prefix="oc-bench-sbx-", dir=args.root
    ) as root:
        repos = {f"synthetic{args.files}": synthetic_repo(Path(tmp) / "repo", args.files)}
        if args.real_dir:
            repos[f"real:{args.real_dir}"] = args.real_dir.resolve()
        for repo_name, repo in repos.items():
            for backend in args.backends.split(","):
                key = f"{backend}/{repo_name}"
                try:
                    results[key] = bench(SandboxSpec(base_dir=repo), backend, args.n, Path(root))
                except SandboxUnavailable as e:
                    results[key] = {"unavailable": str(e)}

    print(f"{'backend/repo':<32}{'step':<12}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for key, steps in results.items():
        if "unavailable" in steps:
            print(f"{key:<32}unavailable: {steps['unavailable']}")
            continue
        for step, v in steps.items():
            print(f"{key:<32}{step:<12}{v['p50_ms']:>10.2f}{v['p99_ms']:>10.2f}{v['mean_ms']:>10.2f}")
    meta = {
        "bench": "sandbox", "date": time.strftime("%Y-%m-%d"), "n": args.n, "files": args.files,
        "root": str(args.root or tempfile.gettempdir()),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpu {platform.release()}",
    }
    print(json.dumps({**meta, "results": results}, sort_keys=True))


if __name__ == "__main__":
    main()
