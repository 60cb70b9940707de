"""Sandbox latency and capacity on a real repository, against plain ``cp -r`` + subprocess.

For each backend, ``n`` rounds of create -> first exec("true") -> ``EXECS`` more
exec("true") and exec(["true"]) -> edit -> snapshot -> edit -> restore -> exec("true")
-> fork -> close (both), each step timed; then live idle sandboxes: create until
``idle`` exist, one fails or ``budget_s`` runs out, with the memory and disk they hold.
The baseline is measured in the same run on the same repo: ``cp -r`` of the repo (what
a sandbox without copy-on-write pays to create) and a bare ``subprocess`` of the same
commands, ``bash -c true`` (what ``exec("true")`` runs) and ``true`` (``exec(["true"])``).
Exec overhead = sandbox p50 - bare p50 of the same command. ``first_exec`` and
``exec_after_restore`` include waiting for a ``namespace`` sandbox's exec server to start.
Wall times on a shared machine grow with its load, so the CPU time one exec(["true"])
costs (host + exec server + command, ``cpu_ms_per_exec``) is reported next to that of a
bare ``subprocess.run(["true"])``.

The repo is ``repo`` if given, else a copy of whole packages of this interpreter's
site-packages, in name order, until >= 6,000 real source files.

Run: ``opencomposer bench sandbox --backend namespace,local [--repo PATH] [--n 30] [--idle 500]``
(``benchmarks/bench_sandbox.py`` is the older per-step script on a synthetic repo); the
last line printed is JSON.
"""

from __future__ import annotations

import math
import os
import resource
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
from opencomposer.sandbox.base import shell_argv

GOALS = {"create_p50_ms": 20.0, "restore_p50_ms": 10.0, "exec_overhead_p50_ms": 5.0, "live_idle": 500}
STEPS = ("create", "first_exec", "exec", "exec_argv", "snapshot", "restore", "exec_after_restore", "fork", "close")
EXECS = 5  # steady-state execs of each kind per round


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
    cp, run, shell = [], [], []
    for i in range(n):
        if i < copies:
            dst = root / f"cp{i}"
            _timed(cp, subprocess.run, ["cp", "-r", str(repo), str(dst)], check=True)
            shutil.rmtree(dst)
        for _ in range(EXECS):
            _timed(run, subprocess.run, ["true"], check=True)
            _timed(shell, subprocess.run, shell_argv("true"), check=True)
    return {"cp_r": summary(cp), "subprocess": summary(run), "subprocess_shell": summary(shell)}


def lifecycle(spec: SandboxSpec, backend: str, n: int, root: Path) -> dict[str, dict[str, float]]:
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    def run(step: str, sb, command) -> None:
        r = _timed(times[step], sb.exec, command)
        if r.exit_code != 0:
            raise RuntimeError(f"{backend}: exec({command!r}) failed: {r.output}")

    for _ in range(n):
        sb = _timed(times["create"], make_sandbox, spec, backend, root=root)
        run("first_exec", sb, "true")
        for _ in range(EXECS):
            run("exec", sb, "true")
            run("exec_argv", sb, ["true"])
        sb.write_file("bench_edit.txt", b"one\n")
        sid = _timed(times["snapshot"], sb.snapshot)
        sb.write_file("bench_edit.txt", b"two\n")
        _timed(times["restore"], sb.restore, sid)
        run("exec_after_restore", sb, "true")
        child = _timed(times["fork"], sb.fork)
        _timed(times["close"], child.close)
        _timed(times["close"], sb.close)
    return {s: summary(v) for s, v in times.items()}


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _descendants() -> list[int]:
    """Every live process below this one (sandbox servers, bwrap, commands)."""
    out, stack, me = [], [os.getpid()], os.getpid()
    while stack:
        pid = stack.pop()
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                stack += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            continue
        if pid != me and pid not in out:
            out.append(pid)
    return out


def _descendants_pss_bytes() -> int:
    """Proportional set size of every process below this one."""
    total = 0
    for pid in _descendants():
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _cpu_seconds() -> float:
    """CPU time of this process, its reaped children, and every live descendant with the
    children they reaped (a sandbox's exec server and its commands)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    for pid in _descendants():
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in f[11:15]) / tick  # utime stime cutime cstime
        except (OSError, ValueError, IndexError):
            pass
    return total


def cpu_per_exec(run: Callable[[], object], n: int = 200) -> float:
    """CPU milliseconds one ``run()`` costs the whole machine (host, servers, commands):
    unlike wall time, this does not grow with other jobs' load."""
    run()
    c0 = _cpu_seconds()
    for _ in range(n):
        run()
    return round((_cpu_seconds() - c0) * 1000 / n, 3)


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
        out = {"count": len(held), "stopped": stop, "seconds": round(time.monotonic() - t0, 2),
               "host_rss_delta_mb": round((_rss_bytes() - rss0) / 2**20, 1),
               "processes_pss_mb": round(_descendants_pss_bytes() / 2**20, 1),
               "disk_mb": round(_disk_bytes(root) / 2**20, 1)}
        out["kb_per_sandbox"] = round((out["host_rss_delta_mb"] + out["processes_pss_mb"] + out["disk_mb"]) * 1024
                                      / max(1, len(held)), 1)
        if held and hasattr(held[0], "start"):  # sandboxes whose exec server is up: ready for a command
            t, started, why = time.monotonic(), 0, "all started"
            for sb in held:
                if time.monotonic() - t > budget_s:
                    why = f"time budget {budget_s:g} s spent"
                    break
                try:
                    sb.start()
                except Exception as e:  # what fails first is the finding
                    why = f"start failed: {type(e).__name__}: {e}"[:300]
                    break
                started += 1
            pss = _descendants_pss_bytes() / 2**20
            out["started"] = {"count": started, "stopped": why, "seconds": round(time.monotonic() - t, 2),
                              "processes_pss_mb": round(pss, 1),
                              "kb_per_server": round((pss - out["processes_pss_mb"]) * 1024 / max(1, started), 1)}
            held_ok = held[:started]
        else:
            held_ok = held
        out["sampled_exec_ok"] = sum(sb.exec("true").exit_code == 0 for sb in held_ok[:: max(1, len(held_ok) // 10)])
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
        result["baseline"]["subprocess"]["cpu_ms"] = cpu_per_exec(lambda: subprocess.run(["true"], check=True))
        bare = result["baseline"]["subprocess"]["p50_ms"]
        bare_shell = result["baseline"]["subprocess_shell"]["p50_ms"]
        spec = SandboxSpec(base_dir=repo)
        for backend in backends:
            log(f"{backend}: lifecycle x{n} ...")
            try:
                steps = lifecycle(spec, backend, n, sbx_p)
            except SandboxUnavailable as e:
                result[backend] = {"unavailable": str(e)}
                continue
            with make_sandbox(spec, backend, root=sbx_p) as sb:
                cpu = cpu_per_exec(lambda: sb.exec(["true"]))
            entry: dict = {"steps": steps, "cpu_ms_per_exec": cpu,
                           "cpu_overhead_ms_per_exec": round(cpu - result["baseline"]["subprocess"]["cpu_ms"], 3), "exec_overhead_p50_ms": round(steps["exec"]["p50_ms"] - bare_shell, 3),
                           "exec_argv_overhead_p50_ms": round(steps["exec_argv"]["p50_ms"] - bare, 3),
                           "exec_overhead_p99_ms": round(steps["exec"]["p99_ms"] - result["baseline"]["subprocess_shell"]["p99_ms"], 3)}
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
            rows.append((key, "exec overhead", f"{entry['exec_overhead_p50_ms']:.2f}", f"{entry['exec_overhead_p99_ms']:.2f}"))
        elif isinstance(entry, dict) and "unavailable" in entry:
            rows.append((key, "unavailable", "", entry["unavailable"][:60]))
    return rows
