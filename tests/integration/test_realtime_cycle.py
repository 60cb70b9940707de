"""The real-time loop end to end with tiny-random, as processes talking HTTP:

``opencomposer serve --log-dir`` (A/B arms) <- simulated users through the real harness
(``opencomposer realtime users``) -> session logs (plus a torn line, as a killed writer
leaves) -> ``opencomposer realtime --once``: rewards -> one epoch of GRPO-style updates ->
candidate -> eval gate on a fixture task -> hot-swap into the running server. Then: an
empty window (nothing to train, exit 0), a gate that blocks (no swap, reason recorded),
the A/B report, and an unreachable server. tiny-random writes noise, so every session
fails its tests; what is checked is each stage's output.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import run_cli

from opencomposer.inference.server.process import serve_process

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "configs" / "suites" / "tasks" / "smoke" / "textkit__mean__body"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve-logs")
    with serve_process("--model", "tiny-random", "--port", "0", "--default-max-tokens", "24",
                       "--max-num-seqs", "4", "--log-dir", str(logs), "--ab-model", "tiny-random",
                       "--ab-fraction", "0.3", stop_timeout=20) as ready:
        assert ready["log_dir"] == str(logs)
        yield ready["serving"], logs


def write_config(tmp: Path, url: str, logs: Path, out: Path) -> Path:
    suite = tmp / "gate-suite.toml"
    suite.write_text(f'name = "rt-gate"\n[[source]]\nkind = "dir"\npath = "{TASK}"\nenv = "current"\n')
    cfg = tmp / "realtime.toml"
    cfg.write_text(f"""
[server]
url = "{url}"
[logs]
dir = "{logs}"
[model]
name = "tiny-random"
[train]
lr = 1e-3
temperature = 0.7
bf16 = false
[learn]
batch_completions = 8
max_tokens = 64
[gate]
suite = "{suite}"
backend = "local"
max_new_tokens = 16
n_boot = 200
[agent]
max_turns = 2
max_seconds = 120
command_timeout = 20
[run]
out_dir = "{out}"
""")
    return cfg


def users(url: str, sessions: int, seed: int) -> dict:
    r = run_cli("realtime", "users", "--base-url", url, "--model", "tiny-random", "--suite", "smoke",
                "--sessions", str(sessions), "--max-turns", "2", "--max-tokens", "24", "--seed", str(seed),
                timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def last_json(r: subprocess.CompletedProcess) -> dict:
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_one_cycle_from_served_sessions_to_a_hot_swapped_checkpoint(server, tmp_path):
    url, logs = server
    base = url.removesuffix("/v1")
    t0 = time.time()
    sim = users(url, sessions=3, seed=0)
    assert sim["sessions"] == 3 and sim["errors"] == 0
    assert sim["events"].get("follow_up", 0) >= 1  # failed sessions: users reply (kind depends on patience)
    log_file = max(logs.glob("*.jsonl"))
    with log_file.open("a") as f:
        f.write('{"type": "completion", "t": 1, "id": "torn')  # what a killed writer leaves
    out = tmp_path / "rt"
    cfg = write_config(tmp_path, url, logs, out)

    r = run_cli("realtime", "--config", str(cfg), "--once", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    row = last_json(r)
    print(f"cycle 1 ({time.time() - t0:.0f} s incl. users): {json.dumps(row['seconds'])}")
    assert row["outcome"] == "deployed", row
    assert row["window"]["completions"] >= 3 and row["window"]["feedback"] >= 1
    assert row["window"]["skipped_lines"] == 1 and "torn" in r.stderr
    assert row["rewards"]["sessions"] == 3 and row["rewards"]["completions"] == row["window"]["completions"]
    own = row["window"]["completions"] - row["samples"]["skipped"].get("other_arm", 0)
    assert row["samples"]["usable"] == own > 0 and set(row["samples"]["skipped"]) <= {"other_arm"}
    assert row["rewards"]["reward_max"] > row["rewards"]["reward_min"]  # latency and follow-ups differ
    train = row["train"]
    assert train["optimizer_steps"] >= 1 and train["loss_tokens"] > 0
    candidate = Path(train["candidate"])
    assert (candidate / "model.safetensors").is_file() and (candidate / "config.json").is_file()
    assert row["gate"]["passed"] and row["gate"]["n_tasks"] == 1
    assert row["deploy"]["policy_version"] == train["optimizer_steps"]
    state = json.loads((out / "state.json").read_text())
    assert state["current"] == str(candidate) and state["version"] == train["optimizer_steps"]
    assert (out / "cycles" / "cycle-0001" / "gate.json").is_file()
    arms = httpx.get(base + "/admin/arms", timeout=30).json()["arms"]
    assert arms["a"]["checkpoint"] == str(candidate.resolve()) and arms["a"]["policy_version"] == state["version"]
    assert arms["b"]["policy_version"] == 0  # the other arm keeps its weights

    # nothing new since the cycle: a clear "nothing to train on", exit 0, nothing swapped
    r = run_cli("realtime", "--config", str(cfg), "--once", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    row2 = last_json(r)
    assert row2["outcome"] == "nothing_to_train" and "nothing to train on: 0 completions" in row2["reason"]
    assert json.loads((out / "state.json").read_text())["current"] == str(candidate)

    # the A/B report sees both arms with counts
    rep = last_json(run_cli("realtime", "report", "--log-dir", str(logs), timeout=120))
    assert sum(a["sessions"] for a in rep["arms"].values()) >= 3 and rep["skipped_lines"] == 1
    assert all(a["latency_p50_s"] > 0 for a in rep["arms"].values())


def test_a_failing_gate_blocks_the_swap_and_records_why(server, tmp_path):
    """The current policy's recorded eval is a solved run (the oracle's); any tiny-random
    candidate is worse, so the gate must block it and the server must keep its weights."""
    from opencomposer.eval.run import run_suite
    from opencomposer.eval.suite import load_suite
    from opencomposer.policies.oracle import OraclePolicy

    url, logs = server
    base = url.removesuffix("/v1")
    out = tmp_path / "rt"
    cfg = write_config(tmp_path, url, logs, out)
    solved = run_suite(load_suite(tmp_path / "gate-suite.toml"), OraclePolicy, backend="local", label="oracle",
                       out_dir=tmp_path / "oracle-eval", progress=False)
    assert solved["summary"]["pass@1"] == 1.0
    before = httpx.get(base + "/admin/arms", timeout=30).json()["arms"]["a"]
    users(url, sessions=1, seed=1)
    cfg.write_text(cfg.read_text().replace("max_tokens = 64", "max_tokens = 64\nmax_completions = 2\nonly_own_arm = false"))
    since = time.time() - 600
    out.mkdir(parents=True)
    (out / "state.json").write_text(json.dumps({
        "format": "opencomposer.realtime/1", "current": "tiny-random", "version": 0, "next_since": since,
        "current_eval": str(tmp_path / "oracle-eval" / "results.json"), "cycles": []}))
    r = run_cli("realtime", "--config", str(cfg), "--once", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    row = last_json(r)
    assert row["outcome"] == "blocked" and "worse than A beyond the tolerance" in row["reason"]
    assert row["gate"]["a"] == 1.0 and row["gate"]["b"] == 0.0 and "deploy" not in row
    after = httpx.get(base + "/admin/arms", timeout=30).json()["arms"]["a"]
    assert after["checkpoint"] == before["checkpoint"] and after["policy_version"] == before["policy_version"]
    state = json.loads((out / "state.json").read_text())
    assert state["current"] == "tiny-random" and state["cycles"][-1]["outcome"] == "blocked"


def test_unreachable_server_and_bad_config_exit_2_naming_them(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    cfg = write_config(tmp_path, "http://127.0.0.1:9", logs, tmp_path / "rt")
    r = run_cli("realtime", "--config", str(cfg), "--once", timeout=120)
    assert r.returncode == 2
    assert "server unreachable at http://127.0.0.1:9/admin/arms" in last_json(r)["error"]
    r = run_cli("realtime", "--config", str(cfg), "--every", "soon", timeout=120)
    assert r.returncode == 2 and "--every: 'soon' is not a duration" in last_json(r)["error"]
    cfg.write_text(cfg.read_text().replace("[learn]", "[learn]\nbatch_size = 3"))
    r = run_cli("realtime", "--config", str(cfg), "--once", timeout=120)
    assert r.returncode == 2 and "learn.batch_size" in last_json(r)["error"]
