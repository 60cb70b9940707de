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


def test_bench_train_plain_hf_baseline_on_dense_and_rl_batches_of_a_random_shape():
    """``--arms hf,...``: the plain HF forward + backward + AdamW against the trainer on the same
    batches; ``--batches dense`` gives the same losses (the same cross-entropy), ``rl`` times RL
    steps on GRPO groups; ``--model shape:tiny`` is a random-weight model of that shape."""
    for batches, arms, tokens in (("dense", "hf,packed_whole", "512"), ("rl", "hf,shared_whole,shared", "4096")):
        r = CliRunner().invoke(app, ["bench", "train", "--model", "shape:tiny", "--arms", arms, "--batches", batches,
                                     "--tokens", tokens, "--steps", "1", "--warmup", "0"])
        assert r.exit_code == 0, r.output
        res = json.loads(r.stdout.strip().splitlines()[-1])
        assert res["batches"] == batches and [a["arm"] for a in res["arms"]] == arms.split(",")
        hf, *trainer = res["arms"]
        assert all(a["tokens_per_second"] > 0 and a["model_gflop"] == hf["model_gflop"] > 0 for a in res["arms"])
        assert hf["mfu"] is None and res["datasheet_peak_gflops"] is None  # a CPU has no datasheet bf16 peak
        if batches == "dense":  # the same loss on the same weights and windows, to float rounding
            assert trainer[0]["max_loss_diff"] < 1e-4, res
        else:  # an RL step's loss is not cross-entropy; the two trainer arms agree with each other
            assert trainer[0]["max_loss_diff"] is None
            assert abs(trainer[1]["losses"][0] - trainer[0]["losses"][0]) < 1e-4
            assert trainer[0]["run_fraction"] < 1  # a group's shared prompt runs once a row


def test_bench_train_refuses_an_unknown_batch_kind():
    r = CliRunner().invoke(app, ["bench", "train", "--model", "tiny-random", "--batches", "sparse"])
    assert r.exit_code != 0 and "--batches 'sparse': expected one of oracle, rl, dense" in r.output


def test_bench_train_fp8_arm_is_skipped_without_fp8_and_measured_with_it(monkeypatch):
    """``packed_fp8`` against ``packed_whole`` on the same dense windows: on a CPU it is skipped with the
    reason (FP8 GEMMs need CUDA 8.9+); with ``OPENCOMPOSER_FP8_ALLOW_CPU=1`` it runs there and reports
    which layers went to float8, its losses within float8's rounding of bf16's."""
    args = ["bench", "train", "--model", "tiny-random", "--arms", "packed_whole,packed_fp8", "--batches", "dense",
            "--tokens", "256", "--steps", "1", "--warmup", "0"]
    monkeypatch.delenv("OPENCOMPOSER_FP8_ALLOW_CPU", raising=False)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert [a["arm"] for a in res["arms"]] == ["packed_whole"]
    assert "compute capability 8.9" in res["skipped_arms"]["packed_fp8"] and "skipped: FP8 GEMMs" in r.output

    monkeypatch.setenv("OPENCOMPOSER_FP8_ALLOW_CPU", "1")
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    bf16, fp8 = res["arms"]
    assert res["skipped_arms"] == {} and fp8["settings"]["fp8"] == "tensorwise"
    assert fp8["fp8"]["converted"] == 14 and list(fp8["fp8"]["skipped"]) == ["lm_head"]
    assert fp8["tokens_per_second"] > 0 and "mfu_of_gemm_peak" in fp8 and "fp8" not in bf16
    assert fp8["max_loss_diff"] < 0.01 * bf16["losses"][0]
