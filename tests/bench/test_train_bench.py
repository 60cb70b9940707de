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


def test_bench_train_refuses_an_unknown_arm():
    r = CliRunner().invoke(app, ["bench", "train", "--model", "tiny-random", "--arms", "baseline,fastest"])
    assert r.exit_code != 0 and "unknown arm(s) fastest" in r.output


def test_bench_train_refuses_an_unknown_device():
    r = CliRunner().invoke(app, ["bench", "train", "--model", "tiny-random", "--device", "tpu"])
    assert r.exit_code != 0 and "--device 'tpu': expected cpu, cuda or cuda:N" in r.output
