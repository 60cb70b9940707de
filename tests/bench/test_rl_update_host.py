"""benchmarks/rl_update_host.py at tiny size: the trainer's real grouping, collation and RL update
counted; packed rows take log-probs at the loss tokens only, padded rows at every row's kept column;
bad budgets are refused."""

from __future__ import annotations

import json

import pytest

from opencomposer.train.micro_batches import group_samples
from testkit.scripts import load_benchmark

rh = load_benchmark("rl_update_host")


def test_layouts_are_counted_through_the_trainer(capsys):
    assert rh.main(["--layers", "2", "--samples", "12", "--budgets", "16384,65536"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {(r["layout"], r["micro_batch_tokens"]): r for r in out["rows"]}
    assert set(rows) == {("padded", 16384), ("padded", 65536), ("packed", 16384), ("packed", 65536)}
    full = rh.as_samples(rh.long_run_samples(12), 1)
    assert out["loss_tokens"] == sum(s.loss_tokens for s in full) and out["tokens"] == sum(len(s) for s in full)
    for (lay, budget), r in rows.items():
        assert r["micro_batches"] == len(group_samples(full, budget, lay == "packed", False))
        assert r["ops"] > r["micro_batches"] * 100  # a forward and backward of 2 layers, each micro-batch
    # packed rows hold no padding and take the head at the loss tokens alone; padded rows pay for both
    for budget in (16384, 65536):
        assert rows[("packed", budget)]["head_per_loss_token"] == 1.0
        assert rows[("packed", budget)]["tokens_computed"] == out["tokens"]
        assert rows[("padded", budget)]["head_per_loss_token"] > 1.0
        assert rows[("padded", budget)]["tokens_computed"] > out["tokens"]
    # fewer, larger micro-batches: fewer ops an update; the first row prices an op at --measured-s
    assert rows[("padded", 65536)]["micro_batches"] < rows[("padded", 16384)]["micro_batches"]
    assert rows[("padded", 65536)]["ops"] < rows[("padded", 16384)]["ops"]
    assert out["rows"][0]["host_s"] == 13.2


@pytest.mark.parametrize("args, match", [(["--budgets", "16k"], "expected comma-separated token counts"),
                                         (["--budgets", "512"], "each at least 1024 tokens")])
def test_bad_budgets_are_refused(args, match):
    with pytest.raises(SystemExit, match=match):
        rh.main(args)
