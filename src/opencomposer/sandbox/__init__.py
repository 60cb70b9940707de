"""Sandboxes: isolated copy-on-write workspaces a rollout (or a deployed agent) works in.

    from opencomposer.sandbox import make_sandbox
    with make_sandbox(SandboxSpec(base_dir=repo), backend="namespace") as sb:
        sb.exec("pytest -q"); sid = sb.snapshot(); ...; sb.restore(sid); sb.reset()
    backend = resolve_backend(args.sandbox)   # "auto" -> namespace, else gvisor, else an error

Commands that run model-driven code choose their backend with ``resolve_backend``: ``auto``
(every command's default) is the strongest isolating backend that runs here, ``namespace``
and else ``gvisor``, or an error saying why neither runs; ``local`` isolates nothing and is
used only when named, with a one-line warning (``docs/isolation.md`` has the whole model).

Backends are looked up by name and imported only when chosen (mini-swe-agent style), so
an unused backend costs nothing and may need things this machine lacks:

- ``local``: a temp copy of the base image and host subprocesses; works anywhere.
- ``namespace``: bubblewrap namespaces over an overlay; Linux with user namespaces.
- ``gvisor``: each command under gVisor's user-space kernel (``runsc``); Linux.
- ``docker``: each command in a container of a reachable Docker engine (docker CLI).
- ``remote``: a sandbox of any of these on a Ray actor (``sandbox/remote.py``; the hosts: ``cluster.py``).

``sandbox/pool.py`` keeps pre-warmed sandboxes per spec (asyncio, or threads via
``BlockingSandboxPool``); ``sandbox/branch.py`` forks N sandboxes from one state;
``sandbox/checkpoint.py`` holds memory snapshots (gVisor's ``runsc checkpoint``).

Every backend implements ``protocols.Sandbox`` plus ``reset()``, ``fork()`` and ``with``.

Test: ``pytest tests/unit/sandbox -q``; benchmark: ``python benchmarks/bench_sandbox.py``.
"""

from __future__ import annotations

import importlib
import logging
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


AUTO = "auto"
ISOLATING = ("namespace", "gvisor")  # what ``auto`` tries, strongest-that-is-cheap first
CHOOSE_LOCAL = "--sandbox local, or backend = \"local\" in the config"
NOT_ISOLATED = ("sandbox backend 'local' is not isolated: the agent's commands run as the host user "
                "and can read and write the host's files and network")
log = logging.getLogger(__name__)
_warned: set[str] = set()


def backend_class(backend: str) -> type:
    """The class registered under ``backend`` (``auto``: the one ``resolve_backend`` picks), imported on first use."""
    if backend == AUTO:
        backend = resolve_backend(AUTO)
    try:
        target = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown sandbox backend {backend!r}; known: {', '.join(sorted(BACKENDS))} "
                         f"(or {AUTO}: the strongest isolating one that runs here)") from None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def unavailable_reason(backend: str) -> str | None:
    """None if ``backend`` can run here, else why not (the backend module's own probe, cached there)."""
    module = importlib.import_module(BACKENDS[backend].partition(":")[0])
    return module.unavailable_reason()


def resolve_backend(name: str = AUTO, choose_local: str = CHOOSE_LOCAL) -> str:
    """The backend a command runs model-driven code in, from the name the user gave.

    ``auto``: ``namespace`` if it runs here, else ``gvisor``, else ``SandboxUnavailable`` with
    both reasons and how to ask for ``local`` (``choose_local``: the command's flag or config
    key). A known name is returned as is; ``local`` logs, once per process, that it is not
    isolated. An unknown name is a ``ValueError`` listing the known ones.
    """
    if name == AUTO:
        reasons = {}
        for backend in ISOLATING:
            reasons[backend] = unavailable_reason(backend)
            if reasons[backend] is None:
                return backend
        raise SandboxUnavailable(
            "sandbox 'auto': no isolating backend runs on this machine ("
            + "; ".join(f"{b}: {why}" for b, why in reasons.items())
            + f"). To run the agent's commands without isolation, as the host user, choose it by name: {choose_local}")
    backend_class(name)
    if name == "local" and name not in _warned:  # once: a run makes thousands of sandboxes
        _warned.add(name)
        log.warning("warning: %s (chosen by name)", NOT_ISOLATED)
    return name


def make_sandbox(spec: SandboxSpec, backend: str = AUTO, **kwargs: Any) -> Sandbox:
    """A fresh sandbox of ``spec.base_dir``; ``kwargs`` go to the backend (e.g. ``root=``)."""
    return backend_class(backend)(spec, **kwargs)


__all__ = [
    "AUTO", "BACKENDS", "INITIAL", "ISOLATING", "PathEscape", "Sandbox", "SandboxSpec", "SandboxUnavailable",
    "backend_class", "make_sandbox", "resolve_backend", "unavailable_reason",
]
