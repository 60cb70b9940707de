"""``LocalSandbox``: a private copy of the base image and plain host subprocesses.

No isolation beyond a scrubbed environment and a private working copy: commands can
see the whole host. Use it where namespaces are unavailable (macOS, locked-down CI) or
for speed while developing; use ``NamespaceSandbox`` for rollouts of untrusted code.

Every process it starts carries ``OPENCOMPOSER_SANDBOX=<id>`` in its environment, so
``close()`` can find and kill background jobs even after they ``setsid`` away from the
process group they started in.

Like a namespace sandbox it records itself in the per-host state dir (``cleanup.register``)
before it makes its temp dir: when its process is SIGKILLed, the next process to make a
sandbox (``cleanup.reap_once``) kills what it left running and removes its temp dir.

Test: ``pytest tests/unit/sandbox/test_local.py -q``.
"""

from __future__ import annotations

import os
import signal
import stat
import tempfile
import uuid
import weakref
from pathlib import Path

from opencomposer.protocols import ExecResult, SandboxSpec
from opencomposer.sandbox import cleanup
from opencomposer.sandbox.base import (
    INITIAL,
    SandboxBase,
    check_resolved,
    confine,
    copy_tree,
    remove_tree,
    run_process,
    scrubbed_env,
    shell_argv,
)
from opencomposer.sandbox.execserver import MAX_FILE_READ

def _cleanup(root: Path, sandbox_id: str, pgids: set[int], record: Path | None = None) -> None:
    """Kill what the sandbox started and delete its files; safe to call twice."""
    cleanup.kill_marked(sandbox_id)
    if not os.path.isdir("/proc"):  # no /proc to scan: fall back to process groups
        for pgid in pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    pgids.clear()
    remove_tree(root)
    if record is not None:
        cleanup.unregister(record)


class LocalSandbox(SandboxBase):
    """A sandbox that is a temp directory on the host.

    >>> with LocalSandbox(SandboxSpec(base_dir=Path("repo"))) as sb:
    ...     sb.exec("python -m pytest -q").exit_code
    """

    backend = "local"

    def __init__(self, spec: SandboxSpec, *, root: str | Path | None = None, _copy_from: Path | None = None):
        base = Path(spec.base_dir)
        if not base.is_dir():
            raise FileNotFoundError(f"sandbox base_dir {str(base)!r} is not a directory")
        self.spec = spec
        self.id = uuid.uuid4().hex[:12]
        cleanup.reap_once()  # what a killed process's sandboxes left behind goes first
        self._root = Path(tempfile.mkdtemp(prefix=f"oc-local-{self.id}-", dir=root)).resolve()
        try:
            record = cleanup.register(self.id, self._root, [], backend="local")
        except BaseException:
            remove_tree(self._root)
            raise
        self._ws = self._root / "workspace"
        self._snaps = self._root / "snapshots"
        self._home = self._root / "home"
        self._snaps.mkdir()
        self._home.mkdir()
        self._pgids: set[int] = set()
        self._closed = False
        self._n = 0
        # Registered before the copy, so a failed copy still cleans up.
        self._finalizer = weakref.finalize(self, _cleanup, self._root, self.id, self._pgids, record)
        copy_tree(_copy_from or base, self._ws)
        self.workdir = str(self._ws)

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
        run_cwd = self._host_path(cwd) if cwd else self.workdir
        if not os.path.isdir(run_cwd):
            return ExecResult(1, f"cwd {cwd!r} is not a directory in the workspace")
        full_env = scrubbed_env(self.spec, self.workdir, str(self._home), env)
        full_env[cleanup.MARKER] = self.id
        return run_process(
            shell_argv(command), env=full_env, cwd=run_cwd, stdin=stdin, timeout=timeout,
            max_output=max_output, on_start=lambda p: self._pgids.add(p.pid),
        )

    # ------------------------------------------------------------------ files

    def _host_path(self, path: str) -> str:
        rel = confine(path, self.workdir)
        return check_resolved(os.path.join(self.workdir, rel), self.workdir, path)

    def read_file(self, path: str) -> bytes:
        self._check_open()
        # as the exec server does: no blocking on a FIFO, no more than MAX_FILE_READ bytes
        fd = os.open(self._host_path(path), os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{path} is not a regular file")
            if st.st_size > MAX_FILE_READ:
                raise OSError(f"{path} is {st.st_size} bytes, over the file API's {MAX_FILE_READ}")
            return f.read(MAX_FILE_READ + 1)

    def write_file(self, path: str, data: bytes) -> None:
        self._check_open()
        target = self._host_path(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)

    # ------------------------------------------------------------------ state

    def snapshot(self) -> str:
        self._check_open()
        self._n += 1
        sid = f"s{self._n}"
        copy_tree(self._ws, self._snaps / sid)
        return sid

    def restore(self, snapshot_id: str) -> None:
        self._check_open()
        # INITIAL needs no stored copy: the base image is read-only by contract.
        src = Path(self.spec.base_dir) if snapshot_id == INITIAL else self._snaps / snapshot_id
        if not src.is_dir():
            raise KeyError(f"unknown snapshot {snapshot_id!r} for sandbox {self.id}")
        remove_tree(self._ws)
        copy_tree(src, self._ws)

    def fork(self) -> "LocalSandbox":
        """A new sandbox starting from this one's current files; its ``reset`` comes back here."""
        self._check_open()
        child = LocalSandbox(self.spec, root=self._root.parent, _copy_from=self._ws)
        child._initial_id = child.snapshot()
        return child

    def close(self) -> None:
        self._closed = True
        self._finalizer()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"local sandbox {self.id} is closed")
