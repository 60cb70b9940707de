"""``GVisorSandbox``: each command in a fresh gVisor sandbox (``runsc``), a user-space kernel.

Stronger than ``namespace``: the sandboxed process never talks to the host kernel;
its system calls are served by gVisor's Sentry (a Go kernel in user space, itself
confined by seccomp), and files come through a separate Gofer process. A kernel bug
reachable from a syscall then no longer means a host escape.

Storage is the ``local`` backend's: a private host copy of ``spec.base_dir`` that
takes every change, snapshots are copies of it (see ``LocalSandbox``). Each ``exec``
writes an OCI bundle and runs ``runsc run`` with:

- a read-only root of empty mount points; ``/usr`` (and the ``/bin``, ``/lib`` links),
  the same few files of ``/etc`` as ``namespace``, and ``spec.env_dir`` with its base
  Python bound read-only; other interpreters' site-packages hidden (the list comes
  from ``namespace``, so both backends expose the same host files);
- the workspace bound read-write at ``/workspace``; ``/tmp`` a fresh tmpfs (``HOME=/tmp``);
- ``--network=none`` unless ``spec.network`` (then gVisor's netstack over the host
  network), all capabilities dropped, no new privileges, new pid/ipc/uts/mount ns.

As with ``namespace``, no process outlives its ``exec``. Container ids are unique per
host (runsc names its control socket after them, in the host's abstract namespace). Not running as root adds
``--rootless``. Known limit of Debian 12's ``runsc`` (0.0~20221219) on new kernels:
coreutils' ``ls``/``stat`` (statx) fail with "Invalid argument"; ``find``, ``grep``,
``git`` and Python work, and those are what the harness tools use.

Test: ``pytest tests/unit/sandbox/test_gvisor.py -q`` (skipped where runsc cannot run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import uuid
from functools import lru_cache
from pathlib import Path

from opencomposer.protocols import ExecResult, SandboxLimits, SandboxSpec
from opencomposer.sandbox.base import SandboxUnavailable, check_resolved, confine, remove_tree, run_process, scrubbed_env, shell_argv
from opencomposer.sandbox.checkpoint import MemorySnapshot
from opencomposer.sandbox.hostfs import host_mounts
from opencomposer.sandbox.limits import Counters, Limiter, tree_bytes
from opencomposer.sandbox.cleanup import MARKER
from opencomposer.sandbox.local import LocalSandbox

WORKDIR = "/workspace"
HOME = "/tmp"


def find_runsc() -> str | None:
    return shutil.which("runsc") or next((p for p in ("/usr/bin/runsc", "/usr/local/bin/runsc") if os.path.isfile(p)), None)


def _make_rootfs(rootfs: Path, links: list[tuple[str, str]], mounts: list[dict]) -> None:
    """Empty mount points (dirs or files, like their sources) and the top-level links."""
    for d in ("proc", "dev", "tmp", "workspace", "etc"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for target, link in links:
        os.symlink(target, rootfs / link.lstrip("/"))
    for m in mounts:
        point = rootfs / m["destination"].lstrip("/")
        if point.is_relative_to(rootfs / "usr") or point.exists() or point.is_symlink():
            continue  # inside a bound tree (its own dirs are the mount points) or done
        point.parent.mkdir(parents=True, exist_ok=True)
        if m["type"] == "bind" and os.path.isfile(m["source"]):
            point.touch()
        else:
            point.mkdir()


def oci_rlimits(limits: SandboxLimits | None) -> list[dict]:
    """``spec.limits`` as OCI rlimits, enforced by gVisor's Sentry for every process inside:
    CPU seconds, open files, file size (= ``disk_mb``), address space (= ``memory_mb``, per
    process), no core dumps. (No cgroup: runsc runs with ``--ignore-cgroups``.)"""
    lim, out = limits or SandboxLimits(), [("RLIMIT_CORE", 0, 0)]
    if lim.cpu_seconds:
        out.append(("RLIMIT_CPU", lim.cpu_seconds, lim.cpu_seconds + 1))
    if lim.open_files:
        out.append(("RLIMIT_NOFILE", lim.open_files, lim.open_files))
    if lim.disk_mb:
        out.append(("RLIMIT_FSIZE", lim.disk_mb << 20, lim.disk_mb << 20))
    if lim.memory_mb:
        out.append(("RLIMIT_AS", lim.memory_mb << 20, lim.memory_mb << 20))
    if lim.processes:
        out.append(("RLIMIT_NPROC", lim.processes, lim.processes))
    return [{"type": t, "soft": soft, "hard": hard} for t, soft, hard in out]


def _oci_config(rootfs: Path, argv: list[str], env: dict[str, str], cwd: str, mounts: list[dict],
                rlimits: list[dict] | None = None) -> dict:
    none: list[str] = []
    return {
        "ociVersion": "1.0.0",
        "process": {
            "terminal": False, "user": {"uid": 0, "gid": 0}, "args": argv, "cwd": cwd,
            "env": [f"{k}={v}" for k, v in env.items()],
            "capabilities": {k: none for k in ("bounding", "effective", "permitted", "inheritable", "ambient")},
            "noNewPrivileges": True, "rlimits": rlimits or [],
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "sandbox",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}] + mounts,
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
    }


def runsc_argv(runsc: str, state: Path, network: bool) -> list[str]:
    args = [runsc, "--root", str(state), "--network=host" if network else "--network=none", "--ignore-cgroups"]
    if os.geteuid() != 0:
        args.append("--rootless")
    return args


_PROBE_LOCK = threading.Lock()


def unavailable_reason(runsc: str | None = None) -> str | None:
    """None if ``runsc`` can run a command in our bundle layout here, else why not (cached;
    one probe at a time, as threads of a rollout all ask at once)."""
    with _PROBE_LOCK:
        return _probe(runsc or find_runsc())


@lru_cache(maxsize=None)
def _probe(runsc: str | None) -> str | None:
    if not runsc:
        return "runsc (gVisor) not found: apt-get install -y runsc, or put gVisor's runsc on PATH"
    with tempfile.TemporaryDirectory(prefix="oc-gvisor-probe-") as tmp:
        spec = SandboxSpec(base_dir=Path(tmp))
        links, mounts = host_mounts(spec)
        rootfs, state, bundle = Path(tmp, "rootfs"), Path(tmp, "state"), Path(tmp, "bundle")
        for d in (rootfs, state, bundle):
            d.mkdir()
        _make_rootfs(rootfs, links, mounts)
        cfg = _oci_config(rootfs, ["true"], {"PATH": "/usr/bin:/bin"}, "/", mounts)
        (bundle / "config.json").write_text(json.dumps(cfg))
        try:
            r = subprocess.run(runsc_argv(runsc, state, False) + ["run", "--bundle", str(bundle), f"oc-probe-{uuid.uuid4().hex[:12]}"],
                               capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{runsc} could not run a probe container: {e}"
    if r.returncode != 0:
        err = (r.stderr or r.stdout).decode(errors="replace").strip()[-800:]
        return f"{runsc} cannot start a gVisor sandbox here (exit {r.returncode}): {err}"
    return None


class GVisorSandbox(LocalSandbox):
    """A sandbox whose commands run under gVisor, over a private copy of ``spec.base_dir``.

    >>> with GVisorSandbox(SandboxSpec(base_dir=Path("repo"))) as sb:
    ...     sb.exec("python3 -m pytest -q").exit_code
    """

    backend = "gvisor"

    def __init__(self, spec: SandboxSpec, *, root: str | Path | None = None, runsc: str | None = None,
                 _copy_from: Path | None = None):
        runsc = runsc or find_runsc()
        reason = unavailable_reason(runsc)
        if reason:
            raise SandboxUnavailable(reason)
        self._runsc = runsc
        links, self._mounts = host_mounts(spec)  # before the copy: a bad env_dir leaves nothing
        super().__init__(spec, root=root, _copy_from=_copy_from)
        self.workdir = WORKDIR
        self._state, self._bundles, self._rootfs = (self._root / d for d in ("runsc", "bundles", "rootfs"))
        self._state.mkdir()
        self._bundles.mkdir()
        _make_rootfs(self._rootfs, links, self._mounts)
        self._ws_mount = {"destination": WORKDIR, "type": "bind", "source": str(self._ws), "options": ["rbind", "rw"]}
        (self._root / "logs").mkdir()
        self._runs = 0
        self._services: set[str] = set()
        # Disk: the workspace copy's growth is watched as namespace's upper dir is (rlimits
        # in the OCI config cap each file); explain() words what a command hit the same way.
        self._limiter = Limiter(getattr(spec, "limits", None) or SandboxLimits(), f"oc-{self.id}",
                                disk_root=self._ws, host=None)
        if self._limiter.limits.disk_mb:
            self._limiter.disk_base = tree_bytes(self._ws)

    # ------------------------------------------------------------------ commands

    def exec(
        self,
        command: str | list[str],
        timeout: float = 60.0,
        max_output: int = 32_000,
        stdin: bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        self._check_open()
        workdir = self._container_cwd(cwd)
        if workdir is None:
            return ExecResult(1, f"cwd {cwd!r} is not a directory in the workspace")
        cid, bundle = self._bundle(command, workdir, env)
        try:
            r = run_process(
                self._runsc_cmd("run", "--bundle", str(bundle), cid), env=self._host_env(), stdin=stdin,
                timeout=timeout, max_output=max_output, on_start=lambda p: self._pgids.add(p.pid),
                watch=self._limiter.disk_watch(),
            )
            return self._limiter.explain(r, Counters())
        finally:
            if any(self._state.glob(f"*{cid}*")):  # a killed run leaves its container's state
                self._runsc_cmd_run("delete", "--force", cid)
            remove_tree(bundle)

    def _container_cwd(self, cwd: str | None) -> str | None:
        rel = confine(cwd or ".", WORKDIR)
        if not os.path.isdir(check_resolved(os.path.join(self._ws, rel), str(self._ws), cwd or ".")):
            return None
        return os.path.normpath(os.path.join(WORKDIR, rel))

    def _bundle(self, command: str | list[str], workdir: str, env: dict[str, str] | None, kind: str = "") -> tuple[str, Path]:
        self._runs += 1
        cid = f"oc-{self.id}-{kind}{self._runs}"
        bundle = self._bundles / cid
        bundle.mkdir()
        cfg = _oci_config(self._rootfs, shell_argv(command), scrubbed_env(self.spec, WORKDIR, HOME, env), workdir,
                          self._mounts + [self._ws_mount], oci_rlimits(getattr(self.spec, "limits", None)))
        (bundle / "config.json").write_text(json.dumps(cfg))
        return cid, bundle

    def _host_env(self) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", MARKER: self.id}  # the marker lets close() find runsc

    def _runsc_cmd(self, *args: str) -> list[str]:
        return runsc_argv(self._runsc, self._state, self.spec.network) + list(args)

    def _runsc_cmd_run(self, *args: str, timeout: float = 60, log: Path | None = None) -> subprocess.CompletedProcess:
        if log is None:
            return subprocess.run(self._runsc_cmd(*args), capture_output=True, env=self._host_env(), timeout=timeout)
        with open(log, "ab") as out:
            return subprocess.run(self._runsc_cmd(*args), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                  env=self._host_env(), timeout=timeout)

    # ------------------------------------------------------------------ long-lived processes and memory snapshots

    def start(self, command: str | list[str], *, cwd: str | None = None, env: dict[str, str] | None = None) -> str:
        """Start ``command`` in a container that outlives the call (a dev server, a REPL);
        returns its id for ``output``, ``stop`` and ``checkpoint``. Output goes to a log."""
        self._check_open()
        workdir = self._container_cwd(cwd)
        if workdir is None:
            raise NotADirectoryError(f"cwd {cwd!r} is not a directory in the workspace")
        cid, bundle = self._bundle(command, workdir, env, kind="svc")
        r = self._runsc_cmd_run("run", "--detach", "--bundle", str(bundle), cid, log=self._log(cid))
        if r.returncode != 0:
            self.stop(cid)
            raise RuntimeError(f"gvisor sandbox {self.id}: could not start {command!r} (runsc exit {r.returncode}): "
                               f"{self.output(cid)[-500:]}")
        self._services.add(cid)
        return cid

    def _log(self, cid: str) -> Path:
        return self._root / "logs" / f"{cid}.log"

    def output(self, service: str) -> str:
        """What a started process has written so far (stdout and stderr)."""
        log = self._log(service)
        return log.read_bytes().decode(errors="replace") if log.exists() else ""

    def running(self, service: str) -> bool:
        r = self._runsc_cmd_run("state", service)
        return r.returncode == 0 and json.loads(r.stdout or b"{}").get("status") == "running"

    def stop(self, service: str) -> None:
        """Kill a started process tree and forget it."""
        self._runsc_cmd_run("delete", "--force", service)
        remove_tree(self._bundles / service)
        self._services.discard(service)

    def checkpoint(self, service: str, *, leave_running: bool = True) -> MemorySnapshot:
        """Memory snapshot of a started process tree plus a file snapshot of the same instant.

        gVisor saves the whole sandbox kernel (all processes, memory, open files, pipes)
        from user space, so this works where CRIU cannot (no host kernel support needed).
        The tree stops when saved (so the files agree with the memory); with
        ``leave_running`` it is then restored in place from the image and goes on.
        """
        self._check_open()
        if service not in self._services:
            raise KeyError(f"no started process {service!r} in gvisor sandbox {self.id}")
        bundle = self._bundles / service
        config = json.loads((bundle / "config.json").read_text())
        pending = self._root / "checkpoints" / f"pending-{service}"
        remove_tree(pending)
        pending.mkdir(parents=True)
        r = self._runsc_cmd_run("checkpoint", "--image-path", str(pending), service, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"runsc checkpoint {service} failed: {r.stderr.decode(errors='replace').strip()[-500:]}")
        fs = self.snapshot()  # the tree is stopped: files are as the saved memory knew them
        image = self._root / "checkpoints" / fs
        pending.rename(image)
        self._runsc_cmd_run("delete", "--force", service)
        if leave_running:
            r = self._runsc_cmd_run("restore", "--detach", "--image-path", str(image), "--bundle", str(bundle), service,
                                    log=self._log(service), timeout=300)
            if r.returncode != 0:
                self.stop(service)
                raise RuntimeError(f"runsc could not resume {service} after its checkpoint: {self.output(service)[-500:]}")
        else:
            self.stop(service)
        return MemorySnapshot(backend=self.backend, image_dir=image, fs_snapshot=fs, config=config)

    def restore_checkpoint(self, snap: MemorySnapshot) -> tuple["GVisorSandbox", str]:
        """A new sandbox with the files of ``snap`` and its processes running again from
        the saved memory; returns (sandbox, id of the restored process tree)."""
        self._check_open()
        if snap.backend != self.backend or not snap.image_dir.is_dir():
            raise ValueError(f"not a gvisor memory snapshot of this sandbox: {snap.image_dir}")
        child = GVisorSandbox(self.spec, root=self._root.parent, runsc=self._runsc, _copy_from=self._snaps / snap.fs_snapshot)
        child._initial_id = child.snapshot()
        child._runs += 1
        cid = f"oc-{child.id}-svc{child._runs}"
        bundle = child._bundles / cid
        bundle.mkdir()
        config = json.loads(json.dumps(snap.config))
        config["root"]["path"] = str(child._rootfs)
        config["mounts"] = [child._ws_mount if m["destination"] == WORKDIR else m for m in config["mounts"]]
        (bundle / "config.json").write_text(json.dumps(config))
        r = child._runsc_cmd_run("restore", "--detach", "--image-path", str(snap.image_dir), "--bundle", str(bundle), cid,
                                 log=child._log(cid), timeout=300)
        if r.returncode != 0:
            err = child._log(cid).read_text(errors="replace")[-500:] if child._log(cid).exists() else ""
            child.close()
            raise RuntimeError(f"runsc restore from {snap.image_dir} failed (exit {r.returncode}): {err}")
        child._services.add(cid)
        return child, cid

    # ------------------------------------------------------------------ files

    def _host_path(self, path: str) -> str:
        rel = confine(path, WORKDIR)
        return check_resolved(os.path.join(self._ws, rel), str(self._ws), path)

    # ------------------------------------------------------------------ state

    def fork(self) -> "GVisorSandbox":
        """A new sandbox starting from this one's current files; its ``reset`` comes back here."""
        self._check_open()
        child = GVisorSandbox(self.spec, root=self._root.parent, runsc=self._runsc, _copy_from=self._ws)
        child._initial_id = child.snapshot()
        return child

    def close(self) -> None:
        if not self._closed:
            for service in list(self._services):
                try:
                    self.stop(service)
                except (OSError, subprocess.TimeoutExpired):
                    pass
        super().close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"gvisor sandbox {self.id} is closed")
