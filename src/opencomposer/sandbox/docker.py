"""``DockerSandbox``: each command in a fresh container of a reachable Docker engine.

For hosts that already run Docker (or Podman's docker CLI): isolation is the engine's
(namespaces, cgroups, seccomp, AppArmor/SELinux where set up), optionally gVisor via
``runtime="runsc"``. Only the ``docker`` CLI is used; no Python SDK.

Storage is the ``local`` backend's: a private host copy of ``spec.base_dir`` that
takes every change, bind-mounted read-write at ``/workspace``; snapshots are copies
of it. So the engine must run on this machine (its bind mounts are host paths).

Each ``exec`` is ``docker run --rm`` with ``--network none`` (unless ``spec.network``),
``--read-only`` root, ``--cap-drop ALL``, ``no-new-privileges``, a pids limit, a
private tmpfs ``/tmp`` (``HOME=/tmp``), the caller's uid:gid (files stay the caller's),
and a label naming the sandbox; a command that times out has its container removed
(``docker rm -f``), and ``close()`` removes any container still carrying the label.

The image: by default no image is pulled at all; a tiny local image of empty mount
points (``opencomposer/hostfs``, made once with ``docker import``) gets the same
read-only host files as ``namespace`` and ``gvisor`` (``/usr``, a few of ``/etc``,
``spec.env_dir``), so tasks see the same toolchain on every backend. Pass
``image="python:3.12-slim"`` (already pulled) to use an image's own userland instead;
``spec.env_dir`` is still bound at its host path.

Test: ``pytest tests/unit/sandbox/test_docker.py -q`` (skipped where no engine answers).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
from functools import lru_cache
from pathlib import Path

from opencomposer.protocols import ExecResult, SandboxSpec
from opencomposer.sandbox.base import SandboxUnavailable, check_resolved, confine, run_process, scrubbed_env, shell_argv
from opencomposer.sandbox.hostfs import host_mounts
from opencomposer.sandbox.cleanup import MARKER
from opencomposer.sandbox.local import LocalSandbox

WORKDIR = "/workspace"
HOME = "/tmp"
LABEL = "opencomposer.sandbox"
_CLI_ENV = ("DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CONTEXT", "DOCKER_CERT_PATH", "DOCKER_TLS_VERIFY", "HOME", "XDG_RUNTIME_DIR")


def find_docker() -> str | None:
    return shutil.which("docker")


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """What the docker CLI needs of the host environment (where the engine is), nothing else."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
    env.update({k: os.environ[k] for k in _CLI_ENV if k in os.environ})
    env.update(extra or {})
    return env


def _docker(docker: str, *args: str, input: bytes | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([docker, *args], input=input, capture_output=True, env=cli_env(), timeout=timeout)


@lru_cache(maxsize=None)
def unavailable_reason(docker: str | None = None) -> str | None:
    """None if a Docker engine answers through ``docker``, else why not (cached)."""
    docker = docker or find_docker()
    if not docker:
        return "docker CLI not found on PATH (and no Docker engine to talk to)"
    try:
        r = _docker(docker, "version", "--format", "{{.Server.Version}}", timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"docker engine did not answer: {e}"
    if r.returncode != 0 or not r.stdout.strip():
        err = (r.stderr or r.stdout).decode(errors="replace").strip()[-500:]
        return f"no Docker engine reachable through {docker} (exit {r.returncode}): {err}"
    return None


def _hostfs_tar(links: list[tuple[str, str]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("proc", "dev", "sys", "tmp", "workspace", "etc", "usr"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for target, link in links:
            info = tarfile.TarInfo(link.lstrip("/"))
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buf.getvalue()


def ensure_hostfs_image(docker: str, links: list[tuple[str, str]]) -> str:
    """The local image of empty mount points, imported once (tag = digest of its layout)."""
    data = _hostfs_tar(links)
    tag = f"opencomposer/hostfs:{hashlib.sha256(repr(links).encode()).hexdigest()[:12]}"
    if _docker(docker, "image", "inspect", tag, timeout=30).returncode == 0:
        return tag
    r = _docker(docker, "import", "--message", "opencomposer mount points", "-", tag, input=data, timeout=120)
    if r.returncode != 0:
        raise SandboxUnavailable(f"docker import of the {tag} base image failed: {r.stderr.decode(errors='replace').strip()}")
    return tag


class DockerSandbox(LocalSandbox):
    """A sandbox whose commands run in Docker containers over a private copy of ``spec.base_dir``.

    >>> with DockerSandbox(SandboxSpec(base_dir=Path("repo"))) as sb:
    ...     sb.exec("python3 -m pytest -q").exit_code
    """

    backend = "docker"

    def __init__(self, spec: SandboxSpec, *, root: str | Path | None = None, docker: str | None = None,
                 image: str | None = None, runtime: str | None = None, pids_limit: int = 1024,
                 memory: str | None = None, _copy_from: Path | None = None):
        docker = docker or find_docker()
        reason = unavailable_reason(docker)
        if reason:
            raise SandboxUnavailable(reason)
        self._docker = docker
        links, mounts = host_mounts(spec)
        if image is not None:  # the image brings its own userland: keep only the env binds
            host = {"/usr", "/etc"}
            mounts = [m for m in mounts if m["destination"] not in host and not m["destination"].startswith("/etc/")
                      and not m["destination"].startswith("/usr/")]
        self._image = image or ensure_hostfs_image(docker, links)
        self._opts = {"runtime": runtime, "pids_limit": pids_limit, "memory": memory, "image": image}
        super().__init__(spec, root=root, _copy_from=_copy_from)
        self.workdir = WORKDIR
        self._runs = 0
        flags = ["--rm", "-i", "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                 "--pids-limit", str(pids_limit), "--hostname", "sandbox", "--user", f"{os.getuid()}:{os.getgid()}",
                 "--label", f"{LABEL}={self.id}", "--network", "bridge" if spec.network else "none", "--log-driver", "none"]
        if runtime:
            flags += ["--runtime", runtime]
        if memory:
            flags += ["--memory", memory]
        for m in mounts:
            if m["type"] == "tmpfs":
                flags += ["--mount", f"type=tmpfs,dst={m['destination']},tmpfs-mode=1777"]
            else:
                flags += ["--mount", f"type=bind,src={m['source']},dst={m['destination']},readonly"]
        flags += ["--mount", f"type=bind,src={self._ws},dst={WORKDIR}"]
        self._flags = flags

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
        rel = confine(cwd or ".", WORKDIR)
        if not os.path.isdir(check_resolved(os.path.join(self._ws, rel), str(self._ws), cwd or ".")):
            return ExecResult(1, f"cwd {cwd!r} is not a directory in the workspace")
        self._runs += 1
        name = f"oc-{self.id}-{self._runs}"
        argv = [self._docker, "run", "--name", name, *self._flags, "-w", os.path.normpath(os.path.join(WORKDIR, rel))]
        for k, v in scrubbed_env(self.spec, WORKDIR, HOME, env).items():
            argv += ["-e", f"{k}={v}"]
        argv += [self._image, *shell_argv(command)]
        res = run_process(argv, env=cli_env({MARKER: self.id}), stdin=stdin, timeout=timeout, max_output=max_output,
                          on_start=lambda p: self._pgids.add(p.pid))
        if res.timed_out:  # killing the CLI does not stop the container: the engine must
            _docker(self._docker, "rm", "-f", name, timeout=60)
        return res

    # ------------------------------------------------------------------ files

    def _host_path(self, path: str) -> str:
        rel = confine(path, WORKDIR)
        return check_resolved(os.path.join(self._ws, rel), str(self._ws), path)

    # ------------------------------------------------------------------ state

    def fork(self) -> "DockerSandbox":
        """A new sandbox starting from this one's current files; its ``reset`` comes back here."""
        self._check_open()
        child = DockerSandbox(self.spec, root=self._root.parent, docker=self._docker, _copy_from=self._ws, **self._opts)
        child._initial_id = child.snapshot()
        return child

    def close(self) -> None:
        if not self._closed:
            try:
                r = _docker(self._docker, "ps", "-aq", "--filter", f"label={LABEL}={self.id}", timeout=30)
                ids = r.stdout.decode().split()
                if ids:
                    _docker(self._docker, "rm", "-f", *ids, timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        super().close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"docker sandbox {self.id} is closed")
