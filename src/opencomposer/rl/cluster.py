"""An RL run's rollout side on a Ray cluster (``[cluster]``): engine actors and sandbox hosts
placed on the cluster's nodes; the trainer stays where ``opencomposer train`` runs (one
process, or torchrun's ranks with the actor on rank 0).

    [cluster]
    ray = "auto"            # join the cluster (RAY_ADDRESS, or the one `ray start` made here)
    engines = 4             # engine actors: `opencomposer serve` following the [sync] store
    engine_gpus = 1         # each asks Ray for one GPU (0: CPU engines)
    sandbox_hosts = 8       # SandboxHost actors: every rollout's and grader's sandbox
    [rollout]
    engine = "server"       # the engines are servers (no base_url: the actors are the servers)
    [sync]
    store = "s3://bucket/runs/rl-7"   # what every node reads the weights from

The same config runs on one machine (``ray = "local"``: a Ray started here, with
``local_cpus`` / ``local_gpus``, the trainer's GPUs left out) or on many.

``RayCluster.start`` joins (or starts) Ray, checks the cluster can hold what is asked (CPUs,
GPUs and custom resources in total; a miss is a ``ClusterError`` naming the setting and what
the cluster has), starts the actors (``SPREAD`` over nodes unless ``spread = false``), and
checks that each can do its work before the first step: every engine reads a probe written
to the weight store, every sandbox host sees the task directory. Engines then sample as
``rollout.engine = "server"`` does with ``rollout.base_urls`` (``rl/engines.py``: a group's
rollouts on one engine, a failed engine out of dispatch, each token tagged with the version
its engine ran); the engines take new weights from the store in flight. An engine that fails
(a request, or the wait for a version at a weight sync) is taken out of dispatch and, at that
sync, replaced by a new actor (``replace``; started and checked as at the start, on the weights
of now); ``cluster.json`` counts the replacements. Sandboxes come from
the hosts (``sandbox/cluster.py``: least-loaded host; the agent's and the grader's sandboxes
are made on the host's node, from paths every node must see at the same place).

``placement()`` (``cluster.json`` in the run directory, written at the start and again at the
end) says which node each actor got and how many sandboxes each host made.
``close()`` stops the actors, and Ray too if the run started it.

Test: ``pytest tests/integration/test_ray_rl.py`` (two Ray nodes on one machine, an RL run
across them, end to end).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opencomposer.config import ConfigError
from opencomposer.protocols import SandboxSpec
from opencomposer.rl.config import ClusterSection, RLRunConfig
from opencomposer.sandbox.cluster import SandboxCluster
from opencomposer.sandbox.remote import RemoteSandbox, _ray


class ClusterError(RuntimeError):
    """The Ray cluster cannot hold or run what ``[cluster]`` asks for; the message says which part."""


class EngineActor:
    """One rollout engine as a Ray actor: ``opencomposer serve`` in a thread of the actor's
    process (``inference/server/host.py``), on its node's address, following the weight store."""

    def __init__(self, serve: dict[str, Any], start_timeout_s: float):
        from opencomposer.inference.server.app import ServeConfig
        from opencomposer.inference.server.host import ServeHost

        ray = _ray()
        self.host = ServeHost(ServeConfig(**serve), bind=ray.util.get_node_ip_address(),
                              start_timeout_s=start_timeout_s)

    def url(self) -> str:
        return self.host.url()

    def info(self) -> dict[str, Any]:
        ray = _ray()
        return {**self.host.info(), "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def read(self, store: str, key: str) -> str | None:
        """None if this node reads ``key`` of ``store``, else why not."""
        from opencomposer.sync.store import open_store

        try:
            open_store(store).get(key)
        except Exception as e:  # noqa: BLE001 - any failure is the answer, named to the caller
            return f"{type(e).__name__}: {e}"
        return None

    def stop(self) -> None:
        self.host.stop()


def absolute(uri: str, path: bool = False) -> str:
    """A relative path made absolute (actors on other nodes may run in another directory):
    ``path=True`` (a store: anything but s3:// is a path) or a path that exists here (a model
    directory); s3:// and names that are no path here (hub ids, registry names) stay as they are."""
    if uri.startswith("s3://"):
        return uri
    p = Path(uri.removeprefix("file://"))
    return str(p.absolute()) if (path or uri.startswith("file://") or p.exists()) else uri


def connect(c: ClusterSection) -> bool:
    """Join the Ray cluster of ``c.ray`` (or start one here, ``"local"``); True if this call
    started it (``close`` then shuts it down). A Ray this process joined already is used as is."""
    ray = _ray()
    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "configure_logging": False}
    try:
        if c.ray == "local":
            # the local Ray sees only the GPUs it may give (local_gpus), never the trainer's
            before = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in c.local_gpus)
            try:
                ray.init(num_cpus=c.local_cpus, num_gpus=len(c.local_gpus), include_dashboard=False, **quiet)
            finally:
                if before is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = before
        else:
            ray.init(address=c.ray, **quiet)
    except Exception as e:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError...
        raise ConfigError(f"cluster.ray = {c.ray!r}: could not join a Ray cluster: {type(e).__name__}: {e}") from None
    return True


def check_capacity(c: ClusterSection, total: dict[str, float]) -> None:
    """What the actors ask for, in total, fits what the cluster has (else a ClusterError)."""
    need: dict[str, tuple[float, str]] = {}

    def add(key: str, amount: float, setting: str) -> None:
        if amount > 0:
            have, why = need.get(key, (0.0, ""))
            need[key] = (have + amount, f"{why} + {setting}" if why else setting)

    add("CPU", c.engines * c.engine_cpus, f"cluster.engines x engine_cpus ({c.engines} x {c.engine_cpus:g})")
    add("GPU", c.engines * c.engine_gpus, f"cluster.engines x engine_gpus ({c.engines} x {c.engine_gpus:g})")
    add("CPU", c.sandbox_hosts * c.sandbox_cpus,
        f"cluster.sandbox_hosts x sandbox_cpus ({c.sandbox_hosts} x {c.sandbox_cpus:g})")
    for name, amount in c.engine_resources.items():
        add(name, c.engines * amount, f"cluster.engine_resources.{name} x engines")
    for name, amount in c.sandbox_resources.items():
        add(name, c.sandbox_hosts * amount, f"cluster.sandbox_resources.{name} x sandbox_hosts")
    short = [f"{key}: {amount:g} asked ({why}), the cluster has {total.get(key, 0.0):g}"
             for key, (amount, why) in need.items() if amount > total.get(key, 0.0) + 1e-9]
    if short:
        raise ClusterError(f"cluster.ray = {c.ray!r}: the cluster cannot hold the actors asked for: {'; '.join(short)}")


class RayCluster:
    """The actors of one run; see the module docstring."""

    def __init__(self, cfg: ClusterSection, engines: list[Any], info: list[dict[str, Any]],
                 sandboxes: SandboxCluster | None, started_ray: bool,
                 start_one: Callable[[], tuple[list[Any], list[dict[str, Any]]]]):
        self.cfg, self.engines, self.engine_info = cfg, engines, info
        self.sandboxes, self.started_ray = sandboxes, started_ray
        self.replaced = [0] * len(engines)  # engine actors started again in place of one that failed
        self.start_one = start_one  # one engine actor, started and checked as ``start`` did

    @property
    def urls(self) -> list[str]:
        """Each engine's server, as the actors report it."""
        return [i["url"] for i in self.engine_info]

    def replace(self, i: int) -> str:
        """Engine ``i``'s actor killed (if it still lives) and a new one started and checked in its
        place (Ray places it where there is room); its URL."""
        ray = _ray()
        try:
            ray.kill(self.engines[i])
        except Exception:  # noqa: BLE001 - dead already: nothing to stop
            pass
        handles, info = self.start_one()
        self.engines[i], self.engine_info[i] = handles[0], info[0]
        self.replaced[i] += 1
        return self.urls[i]

    @classmethod
    def start(cls, cfg: RLRunConfig, task_dirs: list[Path], model: str,
              log: Callable[[str], None] = lambda m: None) -> RayCluster:
        """Join Ray, start ``[cluster]``'s actors and check them (module docstring). ``model``:
        what the engines load (the run's weights then come from the store); ``task_dirs``:
        what every sandbox host must see."""
        c = cfg.cluster
        assert c is not None, "RayCluster.start needs a [cluster] section"
        ray = _ray()
        started = connect(c)
        engines: list[Any] = []
        sandboxes: SandboxCluster | None = None
        try:
            check_capacity(c, ray.cluster_resources())
            info: list[dict[str, Any]] = []
            if c.engines:
                engines, info = _start_engines(cfg, model, c.engines)
                log(f"cluster: {len(engines)} engine actor(s) at {', '.join(i['url'] for i in info)}")
            if c.sandbox_hosts:
                sandboxes = _start_sandbox_hosts(cfg, task_dirs)
                log(f"cluster: {c.sandbox_hosts} sandbox host(s) ({cfg.rollout.backend})")
        except BaseException:
            for e in engines:
                ray.kill(e)
            if sandboxes is not None:
                sandboxes.shutdown()
            if started:
                ray.shutdown()
            raise
        return cls(c, engines, info, sandboxes, started, start_one=lambda: _start_engines(cfg, model, 1))

    def sandbox(self, spec: SandboxSpec) -> RemoteSandbox:
        """A sandbox of ``spec`` on the least-loaded host (paths made absolute: the host may run
        in another directory)."""
        assert self.sandboxes is not None, "this run's [cluster] has no sandbox_hosts"
        env = Path(spec.env_dir).absolute() if spec.env_dir is not None else None
        return self.sandboxes.sandbox(dataclasses.replace(spec, base_dir=Path(spec.base_dir).absolute(), env_dir=env))

    def placement(self) -> dict[str, Any]:
        """Which node each actor runs on, and the cluster's nodes and resources."""
        ray = _ray()
        nodes = [{"node_id": n["NodeID"], "address": n["NodeManagerAddress"], "alive": n["Alive"],
                  "resources": n.get("Resources", {})} for n in ray.nodes()]
        hosts = self.sandboxes.info() if self.sandboxes is not None else []
        return {"ray": self.cfg.ray, "nodes": nodes,
                "engines": [{**{k: i[k] for k in ("url", "node_id", "node_ip", "device", "gpu_ids", "pid")},
                             "replaced": n} for i, n in zip(self.engine_info, self.replaced)],
                "sandbox_hosts": [{k: h[k] for k in ("node_id", "host", "pid", "backend", "made")} for h in hosts]}

    def close(self) -> None:
        """Stop the engines and sandbox hosts (every sandbox closed), then Ray if the run started it."""
        ray = _ray()
        if not ray.is_initialized():
            return
        for e in self.engines:
            try:
                ray.get(e.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead engine has nothing left to stop
                pass
            ray.kill(e)
        self.engines = []
        if self.sandboxes is not None and self.sandboxes.hosts:
            self.sandboxes.shutdown()
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False


def _start_engines(cfg: RLRunConfig, model: str, n: int) -> tuple[list[Any], list[dict[str, Any]]]:
    """``n`` engine actors, started, placed and checked (each reads the weight store)."""
    ray = _ray()
    c, r = cfg.cluster, cfg.rollout
    assert c is not None and cfg.sync is not None  # RLRunConfig's validator
    device = "cuda" if c.engine_gpus > 0 else "cpu"
    dtype = c.engine_dtype if c.engine_dtype != "auto" else "bfloat16" if device == "cuda" else "float32"
    store = absolute(cfg.sync.store, path=True)
    serve = {"model": absolute(model), "device": device, "dtype": dtype, "max_num_seqs": r.max_batch,
             "max_pending": max(4 * r.max_batch, 256), "weights_from": store, "weights_poll_s": 0.2}
    actor = ray.remote(EngineActor).options(
        num_cpus=c.engine_cpus, num_gpus=c.engine_gpus, resources=dict(c.engine_resources), max_concurrency=4,
        scheduling_strategy="SPREAD" if c.spread else "DEFAULT")
    handles = [actor.remote(serve, c.start_timeout_s) for _ in range(n)]
    try:
        info = _wait(ray, [h.info.remote() for h in handles], c, "engine")
        _check_store(cfg, store, handles, info)
    except BaseException:
        for h in handles:
            ray.kill(h)
        raise
    return handles, info


def _check_store(cfg: RLRunConfig, store: str, handles: list[Any], info: list[dict[str, Any]]) -> None:
    ray = _ray()
    c = cfg.cluster
    assert c is not None and cfg.sync is not None
    # every engine must read the weights the trainer writes: a probe, read back on each node
    from opencomposer.sync.store import StoreError, open_store

    key = f"cluster-probe/{uuid.uuid4().hex}"
    try:
        local = open_store(store)
        local.put(key, b"probe")
    except StoreError as e:
        raise ConfigError(f"[sync] store: {e}") from None
    try:
        misses = _wait(ray, [h.read.remote(store, key) for h in handles], c, "engine")
    finally:
        local.delete([key])
    bad = [f"engine {i} on node {info[i]['node_ip']} ({info[i]['node_id'][:12]}): {why}"
           for i, why in enumerate(misses) if why]
    if bad:
        raise ClusterError(f"[sync] store = {cfg.sync.store!r}: not every engine can read the weight store (use "
                           f"s3://... or a path on a filesystem every node mounts): {'; '.join(bad)}")


def _start_sandbox_hosts(cfg: RLRunConfig, task_dirs: list[Path]) -> SandboxCluster:
    ray = _ray()
    c, r = cfg.cluster, cfg.rollout
    assert c is not None
    try:
        sandboxes = SandboxCluster.start(c.sandbox_hosts, r.backend, max_concurrency=max(16, r.k * r.tasks_per_step),
                                         num_cpus=c.sandbox_cpus, spread=c.spread, resources=c.sandbox_resources,
                                         timeout=c.start_timeout_s)
    except ray.exceptions.RayError as e:
        raise _start_error(e, c, "sandbox host") from None
    try:
        paths = sorted({str(Path(p).absolute()) for p in task_dirs})
        missing = _wait(ray, [h.missing.remote(paths) for h in sandboxes.hosts], c, "sandbox host")
        info = sandboxes.info()
        bad = [f"sandbox host {i} on node {info[i]['node_id'][:12]} ({info[i]['host']}) misses {m[:2]}"
               + (f" and {len(m) - 2} more" if len(m) > 2 else "") for i, m in enumerate(missing) if m]
        if bad:
            raise ClusterError(f"tasks.dir = {cfg.tasks.dir!r}: the tasks must be at the same path on every node "
                               f"that hosts sandboxes (a shared filesystem): {'; '.join(bad)}")
    except BaseException:
        sandboxes.shutdown()
        raise
    return sandboxes


def _start_error(e: Exception, c: ClusterSection, what: str, i: int | None = None) -> ClusterError:
    ray = _ray()
    which = f"{what} actor {i}" if i is not None else f"a {what} actor"
    if isinstance(e, ray.exceptions.GetTimeoutError):
        return ClusterError(f"{which} was not ready within cluster.start_timeout_s = {c.start_timeout_s:g} s "
                            "(`ray status` shows what the cluster has free)")
    cause = str(e).strip().splitlines()
    return ClusterError(f"{which} failed to start: {cause[-1] if cause else type(e).__name__}")


def _wait(ray: Any, refs: list[Any], c: ClusterSection, what: str) -> list[Any]:
    """``ray.get`` within ``start_timeout_s``; an actor that failed to start or never got placed
    is a ClusterError naming which and why."""
    out = []
    for i, ref in enumerate(refs):
        try:
            out.append(ray.get(ref, timeout=c.start_timeout_s))
        except ray.exceptions.RayError as e:
            raise _start_error(e, c, what, i) from None
    return out
