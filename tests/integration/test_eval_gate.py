"""The eval suite end to end on real runs: the smoke suite through the real harness and
sandboxes, with the oracle (solves every task from its gold patch, through the tools) as
the good checkpoint and a policy that submits without editing as the damaged one.

* the damaged run is blocked by `opencomposer eval compare` (exit 1, JSON last);
* a second, independent run of the good policy passes against the first (exit 0);
* the report is rebuilt from the results files alone;
* bad inputs exit 2 with a reason naming the file/field.

Run: ``pytest tests/integration/test_eval_gate.py`` (about 60 s on 2 busy cores).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import NS_REASON, run_cli

from opencomposer.config import AgentConfig
from opencomposer.eval.run import run_suite
from opencomposer.eval.suite import load_suite
from opencomposer.harness.oracle import OraclePolicy
from opencomposer.harness.scripted import ScriptedPolicy, tool_call

pytestmark = pytest.mark.slow
BACKEND = "local" if NS_REASON else "namespace"


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    # the good checkpoint through the CLI, as a user runs it
    r = run_cli("eval", "--suite", "smoke", "--policy", "oracle", "--k", "2", "--backend", BACKEND,
                "--out", str(root / "good"), "--price", "2.0")
    assert r.returncode == 0, r.stderr
    line = last_json(r.stdout)
    assert line["pass@1"] == 1.0 and line["results"] == str(root / "good" / "results.json")
    suite = load_suite("smoke")
    cfg = AgentConfig(max_turns=10, command_timeout=30)
    run_suite(suite, OraclePolicy, k=2, backend=BACKEND, agent_cfg=cfg, label="oracle-again",
              out_dir=root / "same", progress=False)
    run_suite(suite, lambda task: ScriptedPolicy([[tool_call("submit", message="Done.")]]), k=2,
              backend=BACKEND, agent_cfg=cfg, label="damaged", out_dir=root / "damaged", progress=False)
    return {"good": root / "good", "same": root / "same", "damaged": root / "damaged", "root": root}


def test_results_file_holds_real_episodes(runs):
    res = json.loads((runs["good"] / "results.json").read_text())
    assert res["schema"] == "opencomposer.eval/1" and res["suite"] == "smoke" and res["label"] == "oracle"
    assert len(res["episodes"]) == 10 and {e["sample"] for e in res["episodes"]} == {0, 1}
    assert all(e["reward"] == 1 and e["stop_reason"] == "submitted" and e["tool_calls"] >= 4
               for e in res["episodes"])
    s = res["summary"]
    assert s["per_difficulty"].keys() == {"block", "body", "function"} and s["per_difficulty"]["body"]["n"] == 3
    # cost = tokens x price (same price for prompt and completion here)
    tokens = sum(e["completion_tokens"] + e["prompt_tokens"] for e in res["episodes"])
    assert s["cost_usd"] == pytest.approx(tokens * 2.0 / 1e6) and s["cost_usd"] > 0
    assert len(list((runs["good"] / "transcripts").glob("*.json"))) == 10
    damaged = json.loads((runs["damaged"] / "results.json").read_text())
    assert damaged["summary"]["pass@1"] == 0.0 and damaged["summary"]["tool_calls"] == 1.0


def test_gate_blocks_damaged_and_passes_identical(runs):
    r = run_cli("eval", "compare", str(runs["good"]), str(runs["damaged"]))
    assert r.returncode == 1, r.stderr
    g = last_json(r.stdout)
    assert not g["passed"] and g["delta"] == -1.0 and g["ci_high"] < 0 and g["n_tasks"] == 5
    assert "BLOCKED" in r.stderr
    r = run_cli("eval", "compare", str(runs["good"]), str(runs["same"] / "results.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    g = last_json(r.stdout)
    assert g["passed"] and g["delta"] == 0.0 and g["label_b"] == "oracle-again"
    # a generous tolerance lets even the damaged run through
    r = run_cli("eval", "compare", str(runs["good"]), str(runs["damaged"]), "--tolerance", "1.0")
    assert r.returncode == 0 and last_json(r.stdout)["passed"]


def test_report_rebuilt_from_json_alone(runs, tmp_path):
    only = tmp_path / "only-json"
    for name in ("good", "damaged"):
        (only / name).mkdir(parents=True)
        shutil.copy(runs[name] / "results.json", only / name / "results.json")
    r = run_cli("eval", "report", str(only / "good"), str(only / "damaged"), "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    out = last_json(r.stdout)
    page = Path(out["html"]).read_text()
    assert len(out["pngs"]) == 3 and all(Path(p).stat().st_size > 10_000 for p in out["pngs"])
    assert "data:image/png;base64," in page and "textkit__clamp__function" in page and "damaged" in page


def test_bad_inputs_exit_2(runs, tmp_path):
    bad = tmp_path / "bad.json"
    res = json.loads((runs["good"] / "results.json").read_text())
    bad.write_text(json.dumps({**res, "k": 0}))
    r = run_cli("eval", "compare", str(runs["good"]), str(bad))
    assert r.returncode == 2 and "bad.json: field 'k' is 0" in last_json(r.stdout)["error"]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**res, "suite": "humaneval-20",
                                 "episodes": [{**e, "task_id": "HumanEval_0"} for e in res["episodes"]]}))
    r = run_cli("eval", "compare", str(runs["good"]), str(other))
    assert r.returncode == 2 and "no common tasks" in last_json(r.stdout)["error"]
    r = run_cli("eval", "--suite", "no-such-suite", "--policy", "oracle")
    assert r.returncode == 2 and "known suites" in last_json(r.stdout)["error"]
    r = run_cli("eval", "--suite", "smoke", "--k", "0")
    assert r.returncode == 2 and "--k" in last_json(r.stdout)["error"]
