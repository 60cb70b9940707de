"""What every sandbox backend shares: running a process, capping its output, the
scrubbed environment, path confinement, tree copies, and the ``SandboxBase`` mixin
(``with`` support, ``reset``).

Backends (``local.py``, ``namespace.py``) differ only in *where* a process runs and
how the workspace is stored; the rules for timeouts, output and paths live here once.

Test: ``pytest tests/unit/sandbox -q``.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Callable

from opencomposer.protocols import ExecResult, PathEscape, SandboxSpec
from opencomposer.sandbox.runner import OutputCap, observation, run_capped

__all__ = ["OutputCap", "run_process"]  # OutputCap lives with the runner (stdlib only, see runner.py)

INITIAL = "initial"  # snapshot id of the state a sandbox was created in


class SandboxUnavailable(RuntimeError):
    """The chosen backend cannot run on this machine (says what is missing)."""


# --------------------------------------------------------------------------- processes


def shell_argv(command: str | list[str]) -> list[str]:
    """A string runs under bash (sh if the host has no bash); a list runs as is."""
    if isinstance(command, list):
        return list(command)
    return ["bash" if shutil.which("bash") else "sh", "-c", command]


def run_process(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str | None = None,
    stdin: bytes | None = None,
    timeout: float | None = 60.0,
    max_output: int = 32_000,
    on_start: Callable[[subprocess.Popen], None] | None = None,
    preexec: Callable[[], None] | None = None,
    watch: Callable[[], str | None] | None = None,
    watch_every: float = 0.25,
) -> ExecResult:
    """Run ``argv`` in its own session, stdout+stderr merged and capped, killed at ``timeout``.

    On timeout the whole process group gets SIGKILL (backends whose process tree can
    leave the group, like bwrap's, make sure killing the leader kills the rest).
    After the main process exits we read for at most ``runner.EXIT_GRACE`` seconds more:
    a background job that keeps the pipe open must not hold the call hostage.

    ``preexec`` runs in the child before exec (rlimits, cgroups); ``watch`` is called
    every ``watch_every`` seconds while the command runs, and a reason it returns kills
    the command the way a timeout does, with ``[killed: <reason>]`` in the output.
    """
    code, cap, timed_out, killed_for, seconds = run_capped(
        argv, env=env, cwd=cwd, stdin=stdin, timeout=timeout, max_output=max_output, on_start=on_start,
        preexec=preexec, watch=watch, watch_every=watch_every,
    )
    return ExecResult(code, observation(cap, timed_out, killed_for, timeout), timed_out, cap.truncated, seconds)


# --------------------------------------------------------------------------- environment


def scrubbed_env(
    spec: SandboxSpec, workdir: str, home: str, env: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment a sandboxed command sees, built from nothing: no host variable leaks."""
    path = "/usr/local/bin:/usr/bin:/bin"
    out = {"HOME": home, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "TERM": "dumb"}
    if spec.env_dir is not None:
        env_dir = os.path.abspath(spec.env_dir)
        path = f"{env_dir}/bin:{path}"
        out["VIRTUAL_ENV"] = env_dir
    out["PATH"] = path
    if spec.pythonpath:
        out["PYTHONPATH"] = ":".join(posixpath.join(workdir, p) for p in spec.pythonpath)
    out.update(spec.extra_env)
    out.update(env or {})
    return out


# --------------------------------------------------------------------------- paths


def confine(path: str, root: str) -> str:
    """``path`` relative to ``root`` ('.' for the root), checked lexically.

    Relative paths are taken from ``root``; absolute ones must lie under it. Symlinks
    are the backend's business (``check_resolved`` on the host, ``realpath`` inside).
    """
    if "\0" in path:
        raise PathEscape(f"path {path!r} contains a NUL byte")
    joined = posixpath.normpath(posixpath.join(root, path or "."))
    if joined != root and not joined.startswith(root.rstrip("/") + "/"):
        raise PathEscape(f"path {path!r} resolves to {joined!r}, outside the workspace {root!r}")
    return posixpath.relpath(joined, root)


def check_resolved(host_path: str, root_real: str, shown: str) -> str:
    """Resolve symlinks on the host and refuse a result outside ``root_real``."""
    real = os.path.realpath(host_path)
    if real != root_real and not real.startswith(root_real.rstrip("/") + "/"):
        raise PathEscape(f"path {shown!r} follows a symlink to {real!r}, outside the workspace")
    return real


# --------------------------------------------------------------------------- trees


def copy_tree(src: Path, dst: Path) -> None:
    """Copy ``src`` to a new ``dst`` keeping links, modes, xattrs and device nodes.

    GNU ``cp -a`` is both faster than Python and the only easy way to keep overlay
    whiteouts (0:0 char devices) and opaque-dir xattrs; elsewhere fall back to shutil.
    """
    if shutil.which("cp") and sys.platform.startswith("linux"):
        r = subprocess.run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dst)], capture_output=True)
        if r.returncode != 0:
            raise OSError(f"copy {src} -> {dst} failed: {r.stderr.decode(errors='replace').strip()}")
        return
    shutil.copytree(src, dst, symlinks=True)


def remove_tree(path: Path) -> None:
    """Remove ``path`` even where modes forbid it (overlay leaves a mode-000 ``work/work``). What is gone
    already is no error: another process's reaper (``cleanup.reap``) may remove the same dead sandbox at once
    (two RL arms, or two graders, starting on one machine)."""

    def fix(func, p, exc):
        if isinstance(exc[1], FileNotFoundError):  # rmtree's onerror: (function, path, exc_info)
            return
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
        except OSError:
            pass
        func(p)

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=fix)


# --------------------------------------------------------------------------- mixin


class SandboxBase:
    """Behaviour every backend gets for free: ``with`` blocks and ``reset()``."""

    _initial_id: str = INITIAL

    def restore(self, snapshot_id: str) -> None:  # pragma: no cover - backends override
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - backends override
        raise NotImplementedError

    def reset(self) -> None:
        """Back to the state the sandbox was created (or forked) in."""
        self.restore(self._initial_id)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
