"""Per-sandbox resource limits: rlimits everywhere, cgroups where the host lets us.

Two mechanisms, chosen once per host and reported by ``mechanism()``:

- ``cgroup-v2`` / ``cgroup-v1``: a cgroup per sandbox (``pids.max``, and the memory
  limit with swap off) when a writable cgroup hierarchy with the ``pids`` and
  ``memory`` controllers exists (root on most hosts, a delegated subtree otherwise).
  Caps the sandbox's processes *together*, and the kernel's counters say afterwards
  which limit was hit.
- ``rlimit`` only, anywhere else: ``RLIMIT_DATA`` per process stands in for memory,
  ``RLIMIT_NPROC`` for processes (counted per user namespace, so per sandbox; it is
  never enforced for host root, which is why root hosts want the cgroup).

Always, as rlimits of every process: CPU seconds (``RLIMIT_CPU``), open files
(``RLIMIT_NOFILE``), the largest file (``RLIMIT_FSIZE`` = the disk limit), no core dumps.
Disk: where the host can mount (root), a namespace sandbox keeps its workspace changes
on a tmpfs of ``disk_mb`` (``cleanup.mount_disk``): a hard limit, writes past it fail with
ENOSPC (tmpfs pages count as the sandbox's memory too). Elsewhere, and for ``gvisor``,
the changes are watched: every 0.25 s while a command runs (killed once over
``disk_mb`` and still growing) and after it (a note until files are deleted), so a burst
can overshoot by what the disk takes in ~0.5 s. /tmp is a tmpfs of ``disk_mb`` too.

A sandbox's exec server starts as ``sh`` (joins the cgroups) -> bwrap, once per sandbox
(joining two v1 cgroups costs ~10 ms here: the kernel waits for an RCU grace period per
join); the server sets the rlimits in each command it forks (``rlimits()``), and the
commands inherit the cgroups.

``Limiter.explain`` turns what happened into a line the agent reads, e.g.
``[killed: memory limit 512 MiB exceeded]``.

Test: ``pytest tests/unit/sandbox/test_limits.py -q``.
"""

from __future__ import annotations

import os
import resource
import signal
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

from opencomposer.protocols import ExecResult, SandboxLimits

MiB = 1 << 20
CGROUP_ENV = "OPENCOMPOSER_CGROUP"  # "off" forces rlimits only; a path picks the parent cgroup (v2)
# Joins each cgroup named before "--" ("0" means the writer itself), then execs the rest.
_JOIN = 'while [ "$1" != -- ]; do echo 0 > "$1" || exit 125; shift; done; shift; exec "$@"'
_OOM_TEXT = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")
_FORK_TEXT = ("fork: Resource temporarily unavailable", "fork: retry", "BlockingIOError: [Errno 11]",
              "Resource temporarily unavailable")


# --------------------------------------------------------------------------- cgroups


@dataclass(frozen=True)
class CgroupHost:
    """Where per-sandbox cgroups go: one parent dir (v2) or one per controller (v1)."""

    version: int
    parents: dict[str, str]  # controller -> parent dir ("pids", "memory"; v2 uses one dir for both)

    def dirs(self, name: str) -> dict[str, str]:
        return {c: os.path.join(p, name) for c, p in self.parents.items()}


def _own_cgroup(controller: str) -> str | None:
    """This process's cgroup path in the v1 hierarchy of ``controller`` ('' for v2)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if controller in ctrls.split(","):
                return path
    except OSError:
        pass
    return None


def _writable_dir(parent: str, probe: str) -> bool:
    try:
        os.makedirs(parent, exist_ok=True)
        d = os.path.join(parent, probe)
        os.mkdir(d)
        os.rmdir(d)
        return True
    except OSError:
        return False


def _find_v2() -> CgroupHost | None:
    root = "/sys/fs/cgroup"
    forced = os.environ.get(CGROUP_ENV)
    if forced and forced != "off":
        root = forced
    ctrl = Path(root, "cgroup.controllers")
    if not ctrl.is_file() or not {"pids", "memory"} <= set(ctrl.read_text().split()):
        return None
    parent = os.path.join(root, "opencomposer")
    try:
        os.makedirs(parent, exist_ok=True)
        Path(root, "cgroup.subtree_control").write_text("+pids +memory")
        Path(parent, "cgroup.subtree_control").write_text("+pids +memory")
    except OSError:
        return None
    return CgroupHost(2, {"pids": parent, "memory": parent}) if _writable_dir(parent, f"probe-{os.getpid()}") else None


def _find_v1() -> CgroupHost | None:
    parents = {}
    for c in ("pids", "memory"):
        mount, own = f"/sys/fs/cgroup/{c}", _own_cgroup(c)
        if own is None or not os.path.isfile(os.path.join(mount, "cgroup.procs")):
            return None
        parent = os.path.join(mount, own.lstrip("/"), "opencomposer")
        if not _writable_dir(parent, f"probe-{os.getpid()}"):
            return None
        parents[c] = parent
    return CgroupHost(1, parents)


@lru_cache(maxsize=None)
def cgroup_host() -> CgroupHost | None:
    """The writable cgroup hierarchy to use, or None (then rlimits alone)."""
    if os.environ.get(CGROUP_ENV) == "off" or not os.path.isdir("/sys/fs/cgroup") or not os.path.exists("/bin/sh"):
        return None  # /bin/sh joins the cgroups (``Limiter.join``)
    return _find_v2() or _find_v1()


def mechanism() -> str:
    host = cgroup_host()
    return f"cgroup-v{host.version}+rlimit" if host else "rlimit"


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_int(path: str) -> int:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return 0


def _counter(path: str, key: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


# --------------------------------------------------------------------------- the limiter


@dataclass
class Counters:
    oom_kills: int = 0
    mem_limit_hits: int = 0  # v2: times the sandbox's own limit was reached (an OOM kill without: the host ran out)
    mem_at_limit: bool = False  # v1 (no usable failcnt on new kernels): peak usage reached the limit
    pid_max_hits: int = 0
    disk_bytes: int = 0


def tree_bytes(root: Path) -> int:
    """Disk blocks used under ``root`` (files, dirs and links; hard links once)."""
    total, seen, stack = 0, set(), [str(root)]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_nlink > 1 and not e.is_dir(follow_symlinks=False):
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
    return total


@dataclass
class Limiter:
    """Applies ``limits`` to the processes of one sandbox and explains what they hit.

    ``disk_root`` is the dir whose growth counts against ``disk_mb`` (the overlay's
    upper layer; a full copy, less ``disk_base``, for ``gvisor``). Call ``close()`` to
    remove the sandbox's cgroups.
    """

    limits: SandboxLimits
    name: str
    disk_root: Path | None = None
    host: CgroupHost | None = field(default_factory=cgroup_host)
    cgroups: dict[str, str] = field(default_factory=dict)
    disk_base: int = 0  # bytes of ``disk_root`` that do not count (a full copy's starting size)
    disk_hard: bool = False  # ``disk_root`` is on a tmpfs of ``disk_mb``: nothing to watch

    def planned_cgroups(self) -> list[str]:
        """The cgroup dirs ``open()`` will make (recorded for cleanup before they exist)."""
        return sorted(set(self.host.dirs(self.name).values())) if self.host else []

    def open(self) -> None:
        if self.host is None:
            return
        lim = self.limits
        self.cgroups = self.host.dirs(self.name)
        for d in sorted(set(self.cgroups.values())):
            os.mkdir(d)
        pids, mem = self.cgroups["pids"], self.cgroups["memory"]
        if lim.processes:
            _write(os.path.join(pids, "pids.max"), str(lim.processes))
        if lim.memory_mb:
            nbytes = str(lim.memory_mb * MiB)
            if self.host.version == 2:
                _write(os.path.join(mem, "memory.max"), nbytes)
                if os.path.exists(os.path.join(mem, "memory.swap.max")):
                    _write(os.path.join(mem, "memory.swap.max"), "0")
            else:
                _write(os.path.join(mem, "memory.limit_in_bytes"), nbytes)
                if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), nbytes)

    def cgroup_dirs(self) -> list[str]:
        return sorted(set(self.cgroups.values()))

    # ---------------------------------------------------------------- per command

    def rlimits(self) -> list[tuple[int, int, int]]:
        lim, out = self.limits, [(resource.RLIMIT_CORE, 0, 0)]
        if lim.cpu_seconds:  # SIGXCPU at the limit, SIGKILL a second later if ignored
            out.append((resource.RLIMIT_CPU, lim.cpu_seconds, lim.cpu_seconds + 1))
        if lim.open_files:
            out.append((resource.RLIMIT_NOFILE, lim.open_files, lim.open_files))
        if lim.disk_mb:
            out.append((resource.RLIMIT_FSIZE, lim.disk_mb * MiB, lim.disk_mb * MiB))
        if lim.memory_mb and self.host is None:
            out.append((resource.RLIMIT_DATA, lim.memory_mb * MiB, lim.memory_mb * MiB))
        if lim.processes and self.host is None and os.getuid() != 0:
            # Counted per user namespace, but checked against the host user's count too.
            out.append((resource.RLIMIT_NPROC, lim.processes + _user_processes(), lim.processes + _user_processes()))
        return out

    def join(self, argv: list[str]) -> list[str]:
        """``argv`` made to start inside this sandbox's cgroups: a ``sh`` prefix writes "0"
        (itself) to each ``cgroup.procs`` and execs onwards, so the host spawns without a
        Python ``preexec_fn`` (which forces a full fork of a possibly large host process).
        Rlimits are the exec server's business: it sets them on itself, commands inherit."""
        dirs = self.cgroup_dirs()
        if not dirs:
            return argv
        return ["/bin/sh", "-c", _JOIN, "oc-join", *(os.path.join(d, "cgroup.procs") for d in dirs), "--", *argv]

    def counters(self, disk: bool = True) -> Counters:
        c = Counters()
        if self.cgroups:
            mem, pids = self.cgroups["memory"], self.cgroups["pids"]
            if self.host and self.host.version == 2:
                c.oom_kills = _counter(os.path.join(mem, "memory.events"), "oom_kill")
                c.mem_limit_hits = _counter(os.path.join(mem, "memory.events"), "oom")
            else:
                c.oom_kills = _counter(os.path.join(mem, "memory.oom_control"), "oom_kill")
                peak = _read_int(os.path.join(mem, "memory.max_usage_in_bytes"))
                c.mem_at_limit = bool(self.limits.memory_mb) and peak >= 0.95 * self.limits.memory_mb * MiB
            c.pid_max_hits = _counter(os.path.join(pids, "pids.events"), "max")
        if disk and self.disk_root is not None and self.limits.disk_mb:
            c.disk_bytes = max(0, tree_bytes(self.disk_root) - self.disk_base)
        return c

    def disk_watch(self) -> Callable[[], str | None] | None:
        """A check for ``run_process(watch=...)``: a reason once the workspace is over its
        limit and still growing. A command that only holds or shrinks it runs on, so an
        ``rm`` of a too-large tree may run however long it takes to start (gVisor is slow)."""
        if self.disk_root is None or not self.limits.disk_mb or self.disk_hard:
            return None
        cap, last = self.limits.disk_mb * MiB, [float("inf")]

        def check() -> str | None:
            used = max(0, tree_bytes(self.disk_root) - self.disk_base)
            growing, last[0] = used > last[0], used
            if used > cap and growing:
                return f"disk limit {self.limits.disk_mb} MiB exceeded (workspace changes use {used // MiB} MiB)"
            return None

        return check

    def explain(self, r: ExecResult, before: Counters) -> ExecResult:
        """Append a line per limit the command hit; the agent reads it as the observation."""
        # A hard disk limit is only worth measuring when a write failed on it.
        after = self.counters(disk=not self.disk_hard or "No space left on device" in r.output)
        lim, notes = self.limits, []
        sig = r.exit_code - 128 if r.exit_code > 128 else 0
        own_limit = after.mem_limit_hits > before.mem_limit_hits or after.mem_at_limit
        if after.oom_kills > before.oom_kills and own_limit:
            notes.append(f"killed: memory limit {lim.memory_mb} MiB exceeded")
        elif after.oom_kills > before.oom_kills:  # sandboxed commands are the host OOM killer's first pick
            notes.append("killed: the host ran out of memory (not this sandbox's limit)")
        elif self.host is None and lim.memory_mb and any(t in r.output for t in _OOM_TEXT):
            notes.append(f"memory limit {lim.memory_mb} MiB per process reached: an allocation failed")
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and lim.cpu_seconds and not r.timed_out
                                     and after.oom_kills == before.oom_kills and _cpu_hint(r, lim)):
            notes.append(f"killed: CPU time limit {lim.cpu_seconds} s exceeded")
        if sig == signal.SIGXFSZ:
            notes.append(f"killed: file size limit {lim.disk_mb} MiB exceeded")
        elif lim.disk_mb and "No space left on device" in r.output and "disk limit" not in r.output[-200:]:
            notes.append(f"disk limit {lim.disk_mb} MiB reached: writes fail (workspace changes use "
                         f"{after.disk_bytes // MiB} MiB); delete files to go on")
        elif lim.disk_mb and after.disk_bytes > lim.disk_mb * MiB and "disk limit" not in r.output[-200:]:
            notes.append(f"disk limit {lim.disk_mb} MiB exceeded (workspace changes use "
                         f"{after.disk_bytes // MiB} MiB): delete files, or the next command that writes is killed")
        if after.pid_max_hits > before.pid_max_hits or (
            self.host is None and lim.processes and any(t in r.output for t in _FORK_TEXT)
        ):
            notes.append(f"process limit {lim.processes} reached: new processes were refused")
        if not notes:
            return r
        r.output += "".join(f"\n[{n}]" for n in notes)
        return r

    def close(self) -> None:
        from opencomposer.sandbox.cleanup import kill_sandbox_processes, remove_cgroups

        dirs = self.cgroup_dirs()
        if dirs:
            kill_sandbox_processes(None, dirs)
            remove_cgroups(dirs)
        self.cgroups = {}


def _cpu_hint(r: ExecResult, lim: SandboxLimits) -> bool:
    # SIGKILL from RLIMIT_CPU's hard limit comes only after the soft limit's SIGXCPU was
    # ignored, i.e. after at least cpu_seconds of wall time.
    return r.seconds >= lim.cpu_seconds


def _user_processes() -> int:
    uid, n = os.getuid(), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n
