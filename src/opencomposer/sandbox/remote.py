"""Remote sandboxes on Ray: sandbox hosts are Ray actors, ``RemoteSandbox`` forwards to one.

    import ray
    from opencomposer.sandbox.cluster import SandboxCluster
    ray.init(address="auto")                      # or ray.init(num_cpus=2) for a local one
    cluster = SandboxCluster.start(hosts=4, backend="namespace")   # one actor per node
    with cluster.sandbox(spec) as sb:             # a RemoteSandbox: the Sandbox protocol
        sb.exec("pytest -q")
    cluster.shutdown()

A ``SandboxHost`` actor (``cluster.py``) owns real sandboxes (any local backend: ``local``,
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

from typing import Any

from opencomposer.protocols import ExecResult, SandboxSpec
from opencomposer.sandbox.base import SandboxBase


def _ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is a dependency of this module only
        raise ImportError("remote sandboxes need Ray: pip install ray") from e
    return ray


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

    def fork(self) -> RemoteSandbox:
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
