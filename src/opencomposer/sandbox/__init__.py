"""Sandboxes: isolated copy-on-write workspaces a rollout (or a deployed agent) works in.

    from opencomposer.sandbox import make_sandbox
    with make_sandbox(SandboxSpec(base_dir=repo), backend="namespace") as sb:
        sb.exec("pytest -q"); sid = sb.snapshot(); ...; sb.restore(sid); sb.reset()

Backends are looked up by name and imported only when chosen (mini-swe-agent style), so
an unused backend costs nothing and may need things this machine lacks:

- ``local``: a temp copy of the base image and host subprocesses; works anywhere.
- ``namespace``: bubblewrap namespaces over an overlay; Linux with user namespaces.
- ``gvisor``: each command under gVisor's user-space kernel (``runsc``); Linux.
- ``docker``: each command in a container of a reachable Docker engine (docker CLI).
- ``remote``: a sandbox of any of these on a Ray actor (``sandbox/remote.py``).

``sandbox/pool.py`` keeps pre-warmed sandboxes per spec (asyncio, or threads via
``BlockingSandboxPool``); ``sandbox/branch.py`` forks N sandboxes from one state;
``sandbox/checkpoint.py`` holds memory snapshots (gVisor's ``runsc checkpoint``, or CRIU
where the kernel allows it).

Every backend implements ``protocols.Sandbox`` plus ``reset()``, ``fork()`` and ``with``.

Test: ``pytest tests/unit/sandbox -q``; benchmark: ``python benchmarks/bench_sandbox.py``.
"""

from __future__ import annotations

import importlib
from typing import Any

from opencomposer.protocols import PathEscape, Sandbox, SandboxSpec
from opencomposer.sandbox.base import INITIAL, SandboxUnavailable

BACKENDS: dict[str, str] = {
    "local": "opencomposer.sandbox.local:LocalSandbox",
    "namespace": "opencomposer.sandbox.namespace:NamespaceSandbox",
    "gvisor": "opencomposer.sandbox.gvisor:GVisorSandbox",
    "docker": "opencomposer.sandbox.docker:DockerSandbox",
    "remote": "opencomposer.sandbox.remote:RemoteSandbox",
}


def backend_class(backend: str) -> type:
    """The class registered under ``backend``, imported on first use."""
    try:
        target = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown sandbox backend {backend!r}; known: {', '.join(sorted(BACKENDS))}") from None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def make_sandbox(spec: SandboxSpec, backend: str = "local", **kwargs: Any) -> Sandbox:
    """A fresh sandbox of ``spec.base_dir``; ``kwargs`` go to the backend (e.g. ``root=``)."""
    return backend_class(backend)(spec, **kwargs)


__all__ = [
    "BACKENDS", "INITIAL", "PathEscape", "Sandbox", "SandboxSpec", "SandboxUnavailable",
    "backend_class", "make_sandbox",
]
