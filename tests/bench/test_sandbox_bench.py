"""``opencomposer bench sandbox`` at toy size: real sandboxes, a tiny repo, a few rounds.

Run: ``pytest tests/bench/test_sandbox_bench.py -q``.
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from testkit.sandbox_testutil import NS_REASON
from opencomposer.cli import app
from opencomposer.bench.sandbox import EXECS, GOALS, STEPS, percentile, run_bench


def test_percentile_is_nearest_rank():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile(list(map(float, range(1, 101))), 0.99) == 99.0


def test_run_bench_reports_every_step_and_the_baseline(base_repo, tmp_path):
    res = run_bench(["local", "namespace"], base_repo, n=2, idle=4, idle_budget_s=30, root=tmp_path)
    assert res["files"] == 4 and res["baseline"]["cp_r"]["n"] == 2 and res["baseline"]["subprocess"]["n"] == 2 * EXECS
    assert res["baseline"]["subprocess"]["p50_ms"] > 0 and res["baseline"]["subprocess_shell"]["p50_ms"] > 0
    assert res["local"]["live_idle"]["count"] == 4 and res["local"]["live_idle"]["stopped"] == "target reached"
    assert set(res["local"]["steps"]) == set(STEPS) and res["local"]["steps"]["exec"]["n"] == 2 * EXECS
    assert res["local"]["steps"]["close"]["n"] == 4  # parent and fork, two rounds
    assert res["local"]["vs_goals"]["live_idle"] == [4, GOALS["live_idle"]]
    if NS_REASON is None:
        ns = res["namespace"]
        assert ns["cpu_ms_per_exec"] > 0 and res["baseline"]["subprocess"]["cpu_ms"] > 0
        assert ns["live_idle"]["sampled_exec_ok"] >= 1 and "rlimit" in ns["limits"]
        assert ns["live_idle"]["processes_pss_mb"] < ns["live_idle"]["started"]["processes_pss_mb"]  # idle: no server yet
        started = ns["live_idle"]["started"]
        assert started["count"] == 4 and started["processes_pss_mb"] > 0 and started["kb_per_server"] > 0
        assert ns["exec_overhead_p50_ms"] == round(ns["steps"]["exec"]["p50_ms"] - res["baseline"]["subprocess_shell"]["p50_ms"], 3)
    assert [p.name for p in tmp_path.iterdir()] == ["repo"]  # every sandbox dir removed


def test_cli_prints_json_last(base_repo, tmp_path):
    r = CliRunner().invoke(app, ["bench", "sandbox", "--backend", "local", "--repo", str(base_repo), "--n", "1",
                                 "--idle", "2", "--root", str(tmp_path)])
    assert r.exit_code == 0, r.output
    last = json.loads(r.output.strip().splitlines()[-1])
    assert last["bench"] == "sandbox" and last["local"]["live_idle"]["count"] == 2
    bad = CliRunner().invoke(app, ["bench", "sandbox", "--backend", "local", "--repo", str(tmp_path / "nope")])
    assert bad.exit_code == 2 and "nope" in json.loads(bad.output.strip().splitlines()[-1])["error"]
