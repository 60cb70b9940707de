"""``opencomposer bench engine``'s defaults per device and its input checks (no timing)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from opencomposer.cli import app
from opencomposer.cli.bench import engine_defaults


def test_defaults_are_the_gpu_goals_on_cuda_and_small_fp32_on_the_cpu():
    assert engine_defaults("cuda", None, None) == ("qwen2.5-0.5b,qwen2.5-1.5b", "1,64,256", "bfloat16")
    assert engine_defaults("cpu", None, None) == ("tiny", "1,8", "float32")
    assert engine_defaults("cpu", "smollm2-135m", "1,4", "bfloat16") == ("smollm2-135m", "1,4", "bfloat16")


def test_bad_shape_dtype_and_batches_are_named():
    runner = CliRunner()
    for args, expect in ((["--shapes", "qwen9"], "unknown shape(s) ['qwen9']"),
                         (["--dtype", "float16"], "--dtype: expected bfloat16 or float32, got 'float16'"),
                         (["--batches", "1,x"], "--batches: expected comma-separated integers")):
        r = runner.invoke(app, ["bench", "engine", "--device", "cpu", *args])
        assert r.exit_code != 0
        assert expect in json.loads(r.stdout.strip().splitlines()[-1])["error"], r.stdout
