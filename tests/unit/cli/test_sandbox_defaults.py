"""Every command that runs model-driven (or third-party) commands defaults to the ``auto`` sandbox.

Checked through the commands themselves, not their source: on a machine with no isolating
backend (the two probes replaced: the true outside boundary) each command, given no
backend, stops with exit code 2 before doing any work, saying why and which flag or config
key chooses ``local``; here, where bwrap runs, ``agent`` runs in ``namespace``; and the ``[sandbox] backend`` key of ``opencomposer agent --config`` is obeyed
(it once was read and ignored).

Run: ``pytest tests/unit/cli/test_sandbox_defaults.py -q``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opencomposer.cli import app
from opencomposer.sandbox import gvisor, namespace

ROOT = Path(__file__).resolve().parents[3]
SMOKE = ROOT / "configs" / "suites" / "tasks" / "smoke" / "textkit__clamp__function"
NS_REASON = namespace.unavailable_reason()


def invoke(*args: str):
    r = CliRunner().invoke(app, list(args))
    return r, " ".join(r.stderr.split())  # rich wraps long lines


def last_json(r) -> dict:
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def task(tmp_path: Path) -> Path:
    """A smoke task whose environment is this interpreter's (linked under _envs, as the format asks)."""
    dest = tmp_path / "tasks" / SMOKE.name
    shutil.copytree(SMOKE, dest)
    (tmp_path / "tasks" / "_envs").mkdir()
    (tmp_path / "tasks" / "_envs" / "here").symlink_to(sys.prefix)
    toml = dest / "task.toml"
    toml.write_text(toml.read_text().replace('env = ""', 'env = "../_envs/here"'))
    return dest


@pytest.fixture
def no_isolation(monkeypatch):
    monkeypatch.setattr(namespace, "unavailable_reason", lambda bwrap=None: "no user namespaces here")
    monkeypatch.setattr(gvisor, "unavailable_reason", lambda runsc=None: "runsc not found")


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_each_command_defaults_to_auto(no_isolation, task, tmp_path):
    """Given no backend, every command asks for auto, and says how to choose local instead."""
    rt = write(tmp_path / "realtime.toml", f'[logs]\ndir = "{tmp_path}/logs"\n[model]\nname = "tiny-random"\n'
                                           '[gate]\nsuite = "smoke"\n')
    rl = write(tmp_path / "rl.toml", f'[tasks]\ndir = "{tmp_path}/rl-tasks"\n')
    fac = write(tmp_path / "factory.toml", '[[libraries]]\nspec = "toolz==1.2.0"\n')
    agent_cfg = write(tmp_path / "agent.toml", "[agent]\nmax_turns = 3\n")
    cases = {  # command line -> how the message says local is chosen
        ("agent", "--task", str(task), "--policy", "oracle"): "--sandbox local",
        ("agent", "--task", str(task), "--policy", "oracle", "--config", str(agent_cfg)):
            f'sandbox.backend = "local" in {agent_cfg}',
        ("eval", "--suite", str(task), "--policy", "oracle", "--out", str(tmp_path / "ev")): "--backend local",
        ("tasks", "check", str(task)): "--sandbox local",
        ("tasks", "make", "--source", f"dir:{tmp_path}/nope", "--out", str(tmp_path / "made")): "--sandbox local",
        ("tasks", "make", "--config", str(fac), "--out", str(tmp_path / "made")): f'factory.backend = "local" in {fac}',
        ("tasks", "stats", str(task), "--oracle"): "--sandbox local",
        ("realtime", "users", "--base-url", "http://127.0.0.1:9/v1", "--model", "m"): "--backend local",
        ("realtime", "--config", str(rt), "--once"): f'gate.backend = "local" in {rt}',
        ("train", "--config", str(rl)): f'rollout.backend = "local" in {rl}',
    }
    for args, how in cases.items():
        r, err = invoke(*args)
        assert r.exit_code == 2, (args, r.output)
        assert "no isolating backend runs on this machine" in err, (args, err)
        assert "namespace: no user namespaces here" in err and "gvisor: runsc not found" in err, (args, err)
        assert how in err, (args, how, err)
    assert not (tmp_path / "ev").exists() and not (tmp_path / "made").exists()  # stopped before any work


def test_a_bad_backend_names_the_flag_or_the_config_key(tmp_path, task):
    r, err = invoke("tasks", "check", str(task), "--sandbox", "firecracker")
    assert r.exit_code == 2 and "--sandbox 'firecracker': unknown sandbox backend" in err
    cfg = write(tmp_path / "agent.toml", '[sandbox]\nbackend = "firecracker"\n')
    r, err = invoke("agent", "--task", str(task), "--config", str(cfg))
    assert r.exit_code == 2 and f"{cfg}: key 'sandbox.backend'" in err and "'auto'" in err and "'firecracker'" in err


@pytest.mark.namespace
@pytest.mark.skipif(NS_REASON is not None, reason=str(NS_REASON))
def test_here_auto_runs_namespace_and_the_config_key_is_obeyed(task, tmp_path):
    r, _ = invoke("agent", "--task", str(task), "--policy", "oracle", "--no-verbose", "--transcript", str(tmp_path / "t.json"))
    assert r.exit_code == 0 and last_json(r)["sandbox"] == "namespace"
    local = write(tmp_path / "local.toml", '[sandbox]\nbackend = "local"\n')
    r, _ = invoke("agent", "--task", str(task), "--policy", "oracle", "--no-verbose", "--config", str(local),
                  "--transcript", str(tmp_path / "t.json"))
    assert r.exit_code == 0 and last_json(r)["sandbox"] == "local"
    r, _ = invoke("agent", "--task", str(task), "--policy", "oracle", "--no-verbose", "--config", str(local),
                  "--sandbox", "namespace", "--transcript", str(tmp_path / "t.json"))
    assert r.exit_code == 0 and last_json(r)["sandbox"] == "namespace"  # the flag over the file


def test_an_error_keeps_a_long_path_whole(tmp_path):
    """rich once broke a long config path inside a word ("agent.t oml") at the terminal's width:
    the error line must carry the path as written, to be copied."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    cfg = write(deep / "agent.toml", '[sandbox]\nbackend = "firecracker"\n')
    r = CliRunner().invoke(app, ["agent", "--task", str(SMOKE), "--config", str(cfg)])
    assert r.exit_code == 2 and f"{cfg}: key 'sandbox.backend'" in r.stderr, r.stderr
