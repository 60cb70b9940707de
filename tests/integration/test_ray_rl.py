"""An RL run across a two-node Ray cluster on one machine (``[cluster]``, ``rl/cluster.py``):
two raylets with their own resources, an engine actor (``opencomposer serve`` of tiny-random,
following the run's weight store) and a sandbox host on each, the trainer under torchrun (2 gloo
ranks, rank 0 the actor), real toolz tasks in real sandboxes, two steps end to end; and what a
cluster that cannot hold the actors, or hosts that cannot see the tasks, get.

Run: ``pytest tests/integration/test_ray_rl.py`` (about two minutes on 2 cores; needs PyPI once
for the toolz tasks).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest
from testkit.rl_tasks import write_cfg

ray = pytest.importorskip("ray", reason="ray is not installed (pip install ray)")

from ray.cluster_utils import Cluster  # noqa: E402

from opencomposer.config import load_config  # noqa: E402
from opencomposer.pipeline.run import run_pipeline  # noqa: E402
from opencomposer.rl.cluster import ClusterError, RayCluster  # noqa: E402
from opencomposer.rl.config import RLRunConfig  # noqa: E402


@pytest.fixture(scope="module")
def two_nodes():
    """A head node and a second node, one CPU and one "sandbox" resource each (so two one-CPU
    engines, and two sandbox hosts that need {sandbox = 1}, land one per node)."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"sandbox": 1},
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"sandbox": 1})
    cluster.wait_for_nodes()
    yield cluster.address
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def _config(tmp_path: Path, tasks: Path, out: Path, address: str, extra: str = "", sandbox: int = 1) -> RLRunConfig:
    """Two steps of two groups (k = 2) on two engine actors and two sandbox hosts; all four tasks trained on."""
    text = write_cfg(tmp_path, tasks, out, steps=2, kl=0.05, engine="server", sync=tmp_path / "store").read_text()
    text = text.replace("heldout = 1", "heldout = 0").replace("tasks_per_step = 1", "tasks_per_step = 2")
    text += f'[cluster]\nray = "{address}"\nengines = 2\nengine_cpus = 1\nsandbox_hosts = 2\n{extra}'
    text += f"[cluster.sandbox_resources]\nsandbox = {sandbox}\n"
    p = tmp_path / "cluster.toml"
    p.write_text(text)
    return load_config(p, RLRunConfig)


def test_an_rl_run_under_torchrun_across_two_ray_nodes(two_nodes, toolz_tasks, tmp_path):
    """The trainer sharded over 2 gloo ranks (torchrun), rank 0 the actor joining the Ray
    cluster; an engine actor and a sandbox host on each node."""
    out = tmp_path / "run"
    cfg = _config(tmp_path, toolz_tasks, out, two_nodes)
    config = tmp_path / "cluster.toml"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                           "opencomposer.cli", "train", "--config", str(config)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert cfg.cluster.engines == 2

    placed = json.loads((out / "cluster.json").read_text())  # as the run's end wrote it
    nodes = {n["node_id"] for n in placed["nodes"] if n["alive"]}
    assert len(nodes) == 2
    # one engine and one sandbox host on each node
    assert {e["node_id"] for e in placed["engines"]} == nodes and len(placed["engines"]) == 2
    assert {h["node_id"] for h in placed["sandbox_hosts"]} == nodes and len(placed["sandbox_hosts"]) == 2
    assert all(e["device"] == "cpu" and e["url"].startswith("http://") for e in placed["engines"])
    # every episode's sandbox and its grader's came from the hosts: 2 per episode, 8 episodes, on both
    made = [h["made"] for h in placed["sandbox_hosts"]]
    assert sum(made) == 16 and min(made) > 0, made

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["train_tokens"] > 0 for r in rows)
    for r in rows:  # a group on each engine actor, every episode finished
        assert r["engine_episodes_0"] == r["engine_episodes_1"] == 2, r
        assert r["engines_up"] == 2 and r["failed_rollouts"] == 0 and r["engine_groups_split"] == 0
    # step 2 sampled after the weights of step 1 reached both actors through the store
    assert rows[0]["engine_version_0"] == rows[0]["engine_version_1"] == 0
    assert rows[1]["engine_version_0"] == rows[1]["engine_version_1"] == rows[0]["policy_version"] == 1
    assert rows[1]["staleness_max"] == 0

    # the run stopped its actors and left the cluster it joined running, with its CPUs free again
    ray.init(address=two_nodes, log_to_driver=False, configure_logging=False)
    try:
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("CPU", 0) == 2
    finally:
        ray.shutdown()


def test_a_cluster_that_cannot_hold_the_actors_is_refused_before_any_starts(two_nodes, toolz_tasks, tmp_path):
    cfg = _config(tmp_path, toolz_tasks, tmp_path / "run", two_nodes, extra="engine_gpus = 1\n")
    with pytest.raises(ClusterError, match=r"GPU: 2 asked \(cluster.engines x engine_gpus \(2 x 1\)\), "
                                           r"the cluster has 0"):
        RayCluster.start(cfg, [toolz_tasks], "tiny-random")
    cfg = _config(tmp_path, toolz_tasks, tmp_path / "run", two_nodes, sandbox=2)
    with pytest.raises(ClusterError, match=r"sandbox: 4 asked \(cluster.sandbox_resources.sandbox x sandbox_hosts\), "
                                           r"the cluster has 2"):
        RayCluster.start(cfg, [toolz_tasks], "tiny-random")


def test_sandbox_hosts_that_cannot_see_the_tasks_are_named(two_nodes, toolz_tasks, tmp_path):
    cfg = _config(tmp_path, toolz_tasks, tmp_path / "run", two_nodes).model_copy()
    cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"engines": 0})})
    with pytest.raises(ClusterError, match=r"the tasks must be at the same path on every node .* misses"):
        RayCluster.start(cfg, [tmp_path / "not-on-any-node"], "tiny-random")


def _wait_refused(url: str, timeout: float = 60.0) -> None:
    """Until the server at ``url`` refuses connections (its process is gone)."""
    parts = urllib.parse.urlsplit(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((parts.hostname, parts.port), timeout=1).close()
        except OSError:
            return
        time.sleep(0.05)
    raise AssertionError(f"{url} still accepts connections {timeout:.0f} s after its actor was killed")


def test_an_engine_actor_killed_mid_run_is_replaced_and_the_run_goes_on(two_nodes, toolz_tasks, tmp_path, monkeypatch):
    """Engine 0's actor is killed after step 1: at the next weight sync its wait fails, it is
    taken out and a new actor is started in its place on the weights of then; steps 2 and 3
    run on both engines again. (One group a step, which goes to engine 0 while it is up.)"""
    out = tmp_path / "run"
    cfg = _config(tmp_path, toolz_tasks, out, two_nodes)
    text = (tmp_path / "cluster.toml").read_text().replace("heldout = 0", "heldout = 1").replace(
        "tasks_per_step = 2", "tasks_per_step = 1").replace("steps = 2", "steps = 3").replace(
        "sandbox_hosts = 2", "sandbox_hosts = 0")
    (tmp_path / "cluster.toml").write_text(text)
    cfg = load_config(tmp_path / "cluster.toml", RLRunConfig)
    started: list[RayCluster] = []
    real = RayCluster.start.__func__

    def start(cls, *args, **kwargs):
        started.append(real(cls, *args, **kwargs))
        return started[-1]

    monkeypatch.setattr(RayCluster, "start", classmethod(start))
    killed: list[int] = []

    def on_step(row: dict) -> None:
        if row["step"] == 1:
            info = ray.get(started[0].engines[0].info.remote())
            killed.append(info["pid"])
            ray.kill(started[0].engines[0])
            _wait_refused(info["url"])  # ray.kill returns before the actor is gone

    with pytest.warns(RuntimeWarning, match=r"rollout engine 0 \(http://.*\) failed: EngineError: could not run "
                                            r"version 1"):
        run_pipeline(cfg, log=lambda m: None, on_step=on_step)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["failed_rollouts"] == 0 for r in rows)
    assert rows[0]["engine_episodes_0"] == 2 and rows[0]["engine_version_0"] == 0
    # the new engine 0 served steps 2 and 3 on the learner's versions
    for r, version in zip(rows[1:], (1, 2)):
        assert r["engines_up"] == 2 and r["engine_episodes_0"] == 2 and r["engine_version_0"] == version, r
    placed = json.loads((out / "cluster.json").read_text())
    assert [e["replaced"] for e in placed["engines"]] == [1, 0] and placed["engines"][0]["pid"] != killed[0]
