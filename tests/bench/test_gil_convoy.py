"""benchmarks/bench_gil_convoy.py: the figures it prints, and bad input named."""

from __future__ import annotations

import json
import sys

import pytest
from testkit.scripts import load_benchmark

gc = load_benchmark("bench_gil_convoy")


def test_times_seeded_sampling_alone_and_beside_busy_threads(capsys):
    before = sys.getswitchinterval()
    assert gc.main(["--rows", "4", "--vocab", "16", "--calls", "2", "--switch-ms", "0", "0.1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) >= {"alone", "busy_switch_default", "busy_switch_0.1"}
    assert all(v["uniforms_ms"] > 0 and v["sample_ms"] > 0 for k, v in out.items() if isinstance(v, dict))
    assert sys.getswitchinterval() == before  # the interval it tried is undone


def test_bad_input_is_refused():
    with pytest.raises(SystemExit, match="--rows >= 1"):
        gc.main(["--rows", "0"])
