"""Sandbox hosts on Ray: ``SandboxHost`` actors own real sandboxes on their node, and
``SandboxCluster`` starts them and hands out ``RemoteSandbox`` clients (``remote.py``).

    import ray
    from opencomposer.sandbox.cluster import SandboxCluster
    ray.init(address="auto")                      # or ray.init(num_cpus=2) for a local one
    cluster = SandboxCluster.start(hosts=4, backend="namespace")   # one actor per node
    with cluster.sandbox(spec) as sb:             # a RemoteSandbox: the Sandbox protocol
        sb.exec("pytest -q")
    cluster.shutdown()

A host makes sandboxes of any local backend (``local``, ``namespace``, ``gvisor``,
``docker``) through the backend registry (``sandbox/__init__.py``); the client side,
``remote.py``, needs neither the registry nor this module.

- Hosts are threaded actors (``max_concurrency``): commands of different sandboxes
  on one host run in parallel, as rollouts step K episodes at once.
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

from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import backend_class
from opencomposer.sandbox.remote import RemoteSandbox, _ray


class SandboxHost:
    """Owns sandboxes on one node; run as a Ray actor (``SandboxCluster`` does that)."""

    def __init__(self, backend: str = "local", **backend_kwargs: Any):
        self.backend = backend
        self._cls = backend_class(backend)  # fails here, on the host, if the backend is unknown
        self._kwargs = backend_kwargs
        self._boxes: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.made = 0  # sandboxes made here (forks included), for the run's record of where work ran

    def create(self, spec: SandboxSpec) -> tuple[str, str]:
        """A new sandbox of ``spec``; returns (sandbox id, workdir as commands see it)."""
        sb = self._cls(spec, **self._kwargs)
        return self._add(sb), sb.workdir

    def _add(self, sb) -> str:
        sid = uuid.uuid4().hex[:12]
        with self._lock:
            self._boxes[sid] = sb
            self.made += 1
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
        return {"host": socket.gethostname(), "pid": os.getpid(), "backend": self.backend, "sandboxes": len(self._boxes),
                "made": self.made,
                "node_id": _ray().get_runtime_context().get_node_id()}

    def missing(self, paths: list[str]) -> list[str]:
        """Those of ``paths`` this host's node cannot see (tasks and environments must be on a
        filesystem every node mounts, at the same path)."""
        return [p for p in paths if not os.path.exists(p)]


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
        resources: dict[str, float] | None = None,
        timeout: float | None = None,
        **backend_kwargs: Any,
    ) -> SandboxCluster:
        """Start ``hosts`` actors (Ray must be initialised); each makes ``backend`` sandboxes.

        ``num_cpus=0`` because a host mostly waits on subprocesses; give it CPUs to make
        Ray place at most that many hosts per node; ``resources``: custom Ray resources each
        host needs (e.g. ``{"sandbox": 1}`` for nodes so marked); ``timeout``: seconds to wait
        for every host to start (Ray waits forever for resources no node has; then the hosts are
        killed and Ray's ``GetTimeoutError`` raised).
        """
        ray = _ray()
        if hosts < 1:
            raise ValueError(f"SandboxCluster.start hosts must be >= 1, got {hosts}")
        backend_class(backend)  # an unknown name fails here with a plain ValueError
        actor = ray.remote(SandboxHost).options(
            num_cpus=num_cpus, max_concurrency=max_concurrency, scheduling_strategy="SPREAD" if spread else "DEFAULT",
            resources=dict(resources or {}),
        )
        handles = [actor.remote(backend, **backend_kwargs) for _ in range(hosts)]
        try:
            ray.get([h.info.remote() for h in handles], timeout=timeout)  # a failed start surfaces now, with its cause
        except BaseException:
            for h in handles:
                ray.kill(h)
            raise
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
