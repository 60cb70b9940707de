"""``bench train`` end to end on tiny-random (CPU), through the CLI: each arm reports tokens/s and
peak RSS, the losses agree across arms, a bad arm is named."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from opencomposer.cli import app


def test_bench_train_tiny_through_the_cli():
    r = CliRunner().invoke(app, ["bench", "train", "--model", "tiny-random", "--arms", "baseline,packed_chunked_ckpt",
                                 "--tokens", "256", "--steps", "1", "--warmup", "0"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])  # the last line: one JSON object
    base, new = res["arms"]
    assert base["arm"] == "baseline" and new["settings"]["gradient_checkpointing"] is True
    for arm in res["arms"]:
        assert arm["tokens_per_second"] > 0 and arm["peak_rss_mb"] >= arm["rss_after_load_mb"] > 0
    assert new["max_loss_diff"] < 1e-4 and base["timed_tokens"] == new["timed_tokens"]
    # the same model FLOPs for both (the same samples); the padded arm ran more tokens than it counts
    assert base["model_gflop"] == new["model_gflop"] > 0 and base["run_fraction"] >= 1.0
    assert 0 < new["run_fraction"] <= base["run_fraction"]
    ceiling = res["ceiling"]
    assert ceiling["gemm_peak_gflops"] > 0 and ceiling["model_flop_per_token"] == base["model_flop_per_token"]
    assert ceiling["tokens_per_second_at_gemm_peak"] == round(
        ceiling["gemm_peak_gflops"] * 1e9 / ceiling["model_flop_per_token"], 1)
    for arm in res["arms"]:  # an arm's rate is its model FLOPs over its time, a share of the measured peak
        assert 0 < arm["mfu_of_gemm_peak"] == round(arm["achieved_gflops"] / ceiling["gemm_peak_gflops"], 3)


def test_bench_train_refuses_an_unknown_arm():
    r = CliRunner().invoke(app, ["bench", "train", "--model", "tiny-random", "--arms", "baseline,fastest"])
    assert r.exit_code != 0 and "unknown arm(s) fastest" in r.output


def test_bench_train_refuses_an_unknown_device():
    r = CliRunner().invoke(app, ["bench", "train", "--model", "tiny-random", "--device", "tpu"])
    assert r.exit_code != 0 and "--device 'tpu': expected cpu, cuda or cuda:N" in r.output
