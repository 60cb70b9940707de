"""Sandbox latency and capacity on a real repository, against plain ``cp -r`` + subprocess.

For each backend, ``n`` rounds of create -> exec("true") -> edit -> snapshot -> edit ->
restore -> fork -> close (both), each step timed; then live idle sandboxes: create
until ``idle`` exist, one fails or ``budget_s`` runs out, with the memory and disk they
hold. The baseline is measured in the same run on the same repo: ``cp -r`` of the repo
(what a sandbox without copy-on-write pays to create) and a bare ``subprocess`` of
``true`` (what exec costs without a sandbox).

The repo is ``repo`` if given, else a copy of whole packages of this interpreter's
site-packages, in name order, until >= 6,000 real source files.

Run: ``opencomposer bench sandbox --backend namespace,local [--repo PATH] [--n 30] [--idle 500]``
(``benchmarks/bench_sandbox.py`` is the older per-step script on a synthetic repo); the
last line printed is JSON.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import statistics
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Callable

from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import SandboxUnavailable, make_sandbox

GOALS = {"create_p50_ms": 20.0, "restore_p50_ms": 10.0, "exec_overhead_p50_ms": 5.0, "live_idle": 500}
STEPS = ("create", "exec", "snapshot", "restore", "fork", "close")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (with n < 100, p99 is the maximum)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summary(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": round(statistics.median(ms), 3), "p99_ms": round(percentile(ms, 0.99), 3), "n": len(ms)}


def count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def default_repo(dst: Path, min_files: int = 6000) -> Path:
    """Real source files: whole packages of this interpreter's site-packages, in name
    order, until at least ``min_files`` (all of them if there are fewer)."""
    src = Path(sysconfig.get_paths()["purelib"])
    dst.mkdir(parents=True)
    n = 0
    for entry in sorted(src.iterdir()):
        if n >= min_files:
            break
        if entry.is_dir() and not entry.name.endswith((".dist-info", "__pycache__")):
            subprocess.run(["cp", "-r", str(entry), str(dst / entry.name)], check=True)
            n += count_files(dst / entry.name)
    return dst


def _timed(times: list[float], fn: Callable, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    times.append((time.perf_counter() - t) * 1000)
    return out


def baseline(repo: Path, root: Path, n: int, copies: int = 5) -> dict[str, dict[str, float]]:
    """``cp -r`` of the repo (``copies`` times: seconds each on a big repo) and a bare
    subprocess (``n`` times), the costs a sandbox is measured against."""
    cp, run = [], []
    for i in range(n):
        if i < copies:
            dst = root / f"cp{i}"
            _timed(cp, subprocess.run, ["cp", "-r", str(repo), str(dst)], check=True)
            shutil.rmtree(dst)
        _timed(run, subprocess.run, ["true"], check=True)
    return {"cp_r": summary(cp), "subprocess": summary(run)}


def lifecycle(spec: SandboxSpec, backend: str, n: int, root: Path) -> dict[str, dict[str, float]]:
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    for _ in range(n):
        sb = _timed(times["create"], make_sandbox, spec, backend, root=root)
        r = _timed(times["exec"], sb.exec, "true")
        if r.exit_code != 0:
            raise RuntimeError(f"{backend}: exec('true') failed: {r.output}")
        sb.write_file("bench_edit.txt", b"one\n")
        sid = _timed(times["snapshot"], sb.snapshot)
        sb.write_file("bench_edit.txt", b"two\n")
        _timed(times["restore"], sb.restore, sid)
        child = _timed(times["fork"], sb.fork)
        _timed(times["close"], child.close)
        _timed(times["close"], sb.close)
    return {s: summary(v) for s, v in times.items()}


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _disk_bytes(root: Path) -> int:
    r = subprocess.run(["du", "-sb", str(root)], capture_output=True, text=True)
    return int(r.stdout.split()[0]) if r.returncode == 0 and r.stdout else 0


def live_idle(spec: SandboxSpec, backend: str, target: int, root: Path, budget_s: float) -> dict:
    """Create sandboxes and keep them until ``target``, a failure, or ``budget_s``; then close all."""
    held, stop, rss0, t0 = [], "target reached", _rss_bytes(), time.monotonic()
    try:
        while len(held) < target:
            if time.monotonic() - t0 > budget_s:
                stop = f"time budget {budget_s:g} s spent"
                break
            try:
                held.append(make_sandbox(spec, backend, root=root))
            except Exception as e:  # what fails first is the finding
                stop = f"create failed: {type(e).__name__}: {e}"
                break
        alive = sum(sb.exec("true").exit_code == 0 for sb in held[:: max(1, len(held) // 10)])
        out = {"count": len(held), "stopped": stop, "seconds": round(time.monotonic() - t0, 2),
               "host_rss_delta_mb": round((_rss_bytes() - rss0) / 2**20, 1),
               "disk_mb": round(_disk_bytes(root) / 2**20, 1), "sampled_exec_ok": alive}
        out["kb_per_sandbox"] = round((out["host_rss_delta_mb"] + out["disk_mb"]) * 1024 / max(1, len(held)), 1)
        t = time.monotonic()
        while held:
            held.pop().close()
        out["close_ms_each"] = round((time.monotonic() - t) * 1000 / max(1, out["count"]), 3)
        return out
    finally:
        for sb in held:  # only after an error above
            sb.close()


def run_bench(backends: list[str], repo: Path | None = None, n: int = 30, idle: int = 500,
              idle_budget_s: float = 120.0, root: Path | None = None, log: Callable[[str], None] = lambda m: None) -> dict:
    """Everything the command reports, as one dict (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="oc-bench-") as tmp, \
            tempfile.TemporaryDirectory(prefix="oc-bench-sbx-", dir=root) as sbx:
        tmp_p, sbx_p = Path(tmp), Path(sbx)
        if repo is None:
            log("copying site-packages as the benchmark repo ...")
            repo = default_repo(tmp_p / "repo")
        repo = repo.resolve()
        if not repo.is_dir():
            raise FileNotFoundError(f"--repo {str(repo)!r} is not a directory")
        files = count_files(repo)
        log(f"repo {repo}: {files} files; baseline ...")
        result: dict = {"bench": "sandbox", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpu {platform.release()}",
                        "loadavg": Path("/proc/loadavg").read_text().split()[:3], "repo": str(repo),
                        "files": files, "n": n, "goals": GOALS}
        result["baseline"] = baseline(repo, tmp_p, n)
        bare = result["baseline"]["subprocess"]["p50_ms"]
        spec = SandboxSpec(base_dir=repo)
        for backend in backends:
            log(f"{backend}: lifecycle x{n} ...")
            try:
                steps = lifecycle(spec, backend, n, sbx_p)
            except SandboxUnavailable as e:
                result[backend] = {"unavailable": str(e)}
                continue
            entry: dict = {"steps": steps, "exec_overhead_p50_ms": round(steps["exec"]["p50_ms"] - bare, 3)}
            if backend == "namespace":
                from opencomposer.sandbox.limits import mechanism

                entry["limits"] = mechanism()
            log(f"{backend}: live idle sandboxes (target {idle}) ...")
            entry["live_idle"] = live_idle(spec, backend, idle, sbx_p, idle_budget_s)
            entry["vs_goals"] = {
                "create_p50_ms": [steps["create"]["p50_ms"], GOALS["create_p50_ms"]],
                "restore_p50_ms": [steps["restore"]["p50_ms"], GOALS["restore_p50_ms"]],
                "exec_overhead_p50_ms": [entry["exec_overhead_p50_ms"], GOALS["exec_overhead_p50_ms"]],
                "live_idle": [entry["live_idle"]["count"], GOALS["live_idle"]],
            }
            result[backend] = entry
        return result


def table_rows(result: dict) -> list[tuple[str, str, str, str]]:
    """(what, step, p50, p99) rows for a human-readable table."""
    rows = [("baseline", k, f"{v['p50_ms']:.2f}", f"{v['p99_ms']:.2f}") for k, v in result["baseline"].items()]
    for key, entry in result.items():
        if isinstance(entry, dict) and "steps" in entry:
            rows += [(key, s, f"{v['p50_ms']:.2f}", f"{v['p99_ms']:.2f}") for s, v in entry["steps"].items()]
            li = entry["live_idle"]
            rows.append((key, "live idle", str(li["count"]), f"{li['kb_per_sandbox']} KiB each"))
        elif isinstance(entry, dict) and "unavailable" in entry:
            rows.append((key, "unavailable", "", entry["unavailable"][:60]))
    return rows
