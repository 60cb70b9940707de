"""Remote sandboxes on Ray: sandbox hosts are Ray actors, ``RemoteSandbox`` forwards to one.

    import ray
    from opencomposer.sandbox.remote import SandboxCluster
    ray.init(address="auto")                      # or ray.init(num_cpus=2) for a local one
    cluster = SandboxCluster.start(hosts=4, backend="namespace")   # one actor per node
    with cluster.sandbox(spec) as sb:             # a RemoteSandbox: the Sandbox protocol
        sb.exec("pytest -q")
    cluster.shutdown()

A ``SandboxHost`` actor owns real sandboxes (any local backend: ``local``,
``namespace``, ``gvisor``, ``docker``) on the node it runs on; a ``RemoteSandbox`` on
the rollout machine holds the actor handle and a sandbox id and turns every protocol
call into one actor call. Rollouts on one machine thereby use sandboxes on many.

- Hosts are threaded actors (``max_concurrency``): commands of different sandboxes
  on one host run in parallel, as rollouts step K episodes at once.
- Errors keep their type: a ``PathEscape``, ``FileNotFoundError`` or ``KeyError``
  raised on the host is raised by the client (Ray re-raises the cause's class).
- ``spec.base_dir`` and ``spec.env_dir`` are paths *on the host node*: put task
  directories on a shared file system, or sync them to every node, before starting.
- Placement: ``SandboxCluster.start(spread=True)`` asks Ray to spread hosts over nodes
  (``scheduling_strategy="SPREAD"``); ``cluster.sandbox`` picks the least-loaded host.
- A host that dies takes its sandboxes with it; calls then raise Ray's ``ActorDiedError``.
  ``close()`` of a host (or ``shutdown``) closes every sandbox it made.

Test: ``pytest tests/integration/test_ray_sandboxes.py -q`` (starts a 2-CPU local Ray).
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from typing import Any

from opencomposer.protocols import ExecResult, SandboxSpec
from opencomposer.sandbox.base import SandboxBase


def _ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is a dependency of this module only
        raise ImportError("remote sandboxes need Ray: pip install ray") from e
    return ray


class SandboxHost:
    """Owns sandboxes on one node; run as a Ray actor (``SandboxCluster`` does that)."""

    def __init__(self, backend: str = "local", **backend_kwargs: Any):
        from opencomposer.sandbox import backend_class

        self.backend = backend
        self._cls = backend_class(backend)  # fails here, on the host, if the backend is unknown
        self._kwargs = backend_kwargs
        self._boxes: dict[str, Any] = {}
        self._lock = threading.Lock()

    def create(self, spec: SandboxSpec) -> tuple[str, str]:
        """A new sandbox of ``spec``; returns (sandbox id, workdir as commands see it)."""
        sb = self._cls(spec, **self._kwargs)
        return self._add(sb), sb.workdir

    def _add(self, sb) -> str:
        sid = uuid.uuid4().hex[:12]
        with self._lock:
            self._boxes[sid] = sb
        return sid

    def _get(self, sid: str):
        try:
            return self._boxes[sid]
        except KeyError:
            raise KeyError(f"no sandbox {sid!r} on host {socket.gethostname()} (closed, or made on another host)") from None

    def call(self, sid: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """One protocol method of one sandbox (``exec``, ``read_file``, ``snapshot``...)."""
        if method not in ("exec", "read_file", "write_file", "snapshot", "restore", "reset"):
            raise ValueError(f"sandbox method {method!r} cannot be called remotely")
        return getattr(self._get(sid), method)(*args, **kwargs)

    def fork(self, sid: str) -> tuple[str, str]:
        child = self._get(sid).fork()
        return self._add(child), child.workdir

    def close(self, sid: str) -> None:
        with self._lock:
            sb = self._boxes.pop(sid, None)
        if sb is not None:
            sb.close()

    def close_all(self) -> int:
        with self._lock:
            boxes, self._boxes = list(self._boxes.values()), {}
        for sb in boxes:
            sb.close()
        return len(boxes)

    def info(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "backend": self.backend, "sandboxes": len(self._boxes)}


class RemoteSandbox(SandboxBase):
    """The ``Sandbox`` protocol over a ``SandboxHost`` actor (a client object; cheap to hold).

    ``make_sandbox(spec, backend="remote", host=handle)`` makes one on a given actor.
    """

    backend = "remote"

    def __init__(self, spec: SandboxSpec, *, host: Any = None, _sid: str | None = None, _workdir: str | None = None,
                 _on_close: Any = None):
        if host is None:
            raise ValueError("RemoteSandbox needs host=<SandboxHost actor handle> (see SandboxCluster.start)")
        self._ray = _ray()
        self.spec = spec
        self.host = host
        if _sid is None:
            _sid, _workdir = self._ray.get(host.create.remote(spec))
        self.id = _sid
        self.workdir = _workdir
        self._closed = False
        self._on_close = _on_close  # the cluster's load counter

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError(f"remote sandbox {self.id} is closed")
        return self._ray.get(self.host.call.remote(self.id, method, *args, **kwargs))

    def exec(
        self,
        command: str | list[str],
        timeout: float = 60.0,
        max_output: int = 32_000,
        stdin: bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        return self._call("exec", command, timeout=timeout, max_output=max_output, stdin=stdin, cwd=cwd, env=env)

    def read_file(self, path: str) -> bytes:
        return self._call("read_file", path)

    def write_file(self, path: str, data: bytes) -> None:
        self._call("write_file", path, data)

    def snapshot(self) -> str:
        return self._call("snapshot")

    def restore(self, snapshot_id: str) -> None:
        self._call("restore", snapshot_id)

    def reset(self) -> None:
        self._call("reset")

    def fork(self) -> "RemoteSandbox":
        """A new sandbox on the same host, from this one's current files."""
        if self._closed:
            raise RuntimeError(f"remote sandbox {self.id} is closed")
        sid, workdir = self._ray.get(self.host.fork.remote(self.id))
        return RemoteSandbox(self.spec, host=self.host, _sid=sid, _workdir=workdir)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._on_close is not None:
            self._on_close()
        try:
            self._ray.get(self.host.close.remote(self.id))
        except Exception:  # the host is gone: so is the sandbox
            pass


class SandboxCluster:
    """A set of ``SandboxHost`` actors and least-loaded placement of new sandboxes."""

    def __init__(self, hosts: list[Any]):
        if not hosts:
            raise ValueError("SandboxCluster needs at least one host actor")
        self.hosts = list(hosts)
        self._load = [0] * len(self.hosts)
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls,
        hosts: int = 1,
        backend: str = "local",
        *,
        max_concurrency: int = 16,
        num_cpus: float = 0,
        spread: bool = True,
        **backend_kwargs: Any,
    ) -> "SandboxCluster":
        """Start ``hosts`` actors (Ray must be initialised); each makes ``backend`` sandboxes.

        ``num_cpus=0`` because a host mostly waits on subprocesses; give it CPUs to make
        Ray place at most that many hosts per node.
        """
        from opencomposer.sandbox import backend_class

        ray = _ray()
        if hosts < 1:
            raise ValueError(f"SandboxCluster.start hosts must be >= 1, got {hosts}")
        backend_class(backend)  # an unknown name fails here with a plain ValueError
        actor = ray.remote(SandboxHost).options(
            num_cpus=num_cpus, max_concurrency=max_concurrency, scheduling_strategy="SPREAD" if spread else "DEFAULT",
        )
        handles = [actor.remote(backend, **backend_kwargs) for _ in range(hosts)]
        ray.get([h.info.remote() for h in handles])  # surface a failed start now, with its cause
        return cls(handles)

    def sandbox(self, spec: SandboxSpec) -> RemoteSandbox:
        """A new sandbox of ``spec`` on the host with the fewest sandboxes made through us."""
        with self._lock:
            i = min(range(len(self.hosts)), key=self._load.__getitem__)
            self._load[i] += 1

        def release() -> None:
            with self._lock:
                if i < len(self._load):  # not after shutdown()
                    self._load[i] -= 1

        try:
            return RemoteSandbox(spec, host=self.hosts[i], _on_close=release)
        except BaseException:
            release()
            raise

    def info(self) -> list[dict[str, Any]]:
        ray = _ray()
        return ray.get([h.info.remote() for h in self.hosts])

    def shutdown(self) -> int:
        """Close every sandbox on every host and stop the actors; returns sandboxes closed."""
        ray = _ray()
        closed = sum(ray.get([h.close_all.remote() for h in self.hosts]))
        for h in self.hosts:
            ray.kill(h)
        self.hosts, self._load = [], []
        return closed
