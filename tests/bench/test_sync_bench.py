"""``bench sync`` end to end on the tiny shape (CPU), through the CLI: a trainer's versions
reach a decoding engine exactly, deltas are smaller than the model, bad options named."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from opencomposer.cli import app


def test_bench_sync_tiny_cpu_through_the_cli():
    r = CliRunner().invoke(app, ["bench", "sync", "--shape", "tiny", "--device", "cpu", "--lrs", "1e-6,1e-4",
                                 "--steps", "2", "--batch", "2x32", "--decode-batch", "2"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])  # the last line: one JSON object
    assert res["all_exact"] and res["full"]["exact"] and len(res["versions"]) == 4
    small, large = res["versions"][:2], res["versions"][2:]
    for v in res["versions"]:
        assert 0 < v["changed_fraction"] < 1 and v["stored_mb"] * 2**20 < res["bf16_mb"] * 2**20, v
        assert v["pause_s"] <= v["follow_s"], v
    # a smaller step moves fewer bf16 values, and its delta is smaller
    assert max(v["changed_fraction"] for v in small) < min(v["changed_fraction"] for v in large)
    assert max(v["stored_mb"] for v in small) < min(v["stored_mb"] for v in large)
    assert res["decode_steps"] > 0 and res["baseline_full_safetensors"]["mb"] > 0


def test_bench_sync_refuses_bad_options():
    r = CliRunner().invoke(app, ["bench", "sync", "--shape", "qwen9", "--device", "cpu"])
    assert r.exit_code != 0 and "unknown shape 'qwen9'" in r.output
    r = CliRunner().invoke(app, ["bench", "sync", "--shape", "tiny", "--device", "cpu", "--lrs", "fast"])
    assert r.exit_code != 0 and "--lrs / --batch" in r.output
