"""``bench moe`` end to end on the tiny MoE shape (CPU), through the CLI: every figure present,
the roofline counted from recorded routes, bad options named."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from opencomposer.cli import app


def test_bench_moe_tiny_cpu_through_the_cli():
    r = CliRunner().invoke(app, ["bench", "moe", "--shape", "tiny-moe", "--layers", "2", "--device", "cpu",
                                 "--dtype", "float32", "--batches", "1,4", "--decode-steps", "4", "--prompt-len", "16",
                                 "--prefill", "2x64"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])  # the last line: one JSON object
    assert res["shape"] == "tiny-moe" and res["layers"] == 2 and res["moe_experts"] == "grouped_mm"
    for b in (1, 4):
        d = res[f"decode_b{b}"]
        # a batch of one reads its token's 2 experts per layer; four tokens read 2 to 8 of the 8
        hit = d["engine"]["experts_hit_per_layer"]
        assert (hit == 2.0 if b == 1 else 2.0 <= hit <= 8), d
        assert 0 < d["engine"]["fraction_of_roofline"] and d["engine"]["tokens_per_s"] > 0, d
        assert d["engine_loop"]["tokens_per_s"] > 0 and d["hf"]["tokens_per_s"] > 0, d
        assert d["speedup_vs_hf"] > 0 and d["speedup_vs_loop"] > 0, d
    assert res["prefill"]["engine_tokens_per_s"] > 0 and res["prefill"]["hf_tokens_per_s"] > 0
    # fp32 on the CPU: the engine routes every token as HF does, and its logprobs match
    assert res["parity"]["route_pairs"] > 0 and res["parity"]["routes_differ"] == 0
    assert res["parity"]["logprob_diff_mean_free"] < 1e-5 and res["parity"]["logprob_diff_mean_replayed"] < 1e-5


def test_bench_moe_refuses_bad_options():
    r = CliRunner().invoke(app, ["bench", "moe", "--shape", "qwen9-moe", "--device", "cpu"])
    assert r.exit_code != 0 and "unknown MoE shape 'qwen9-moe'" in r.output
    r = CliRunner().invoke(app, ["bench", "moe", "--shape", "tiny-moe", "--layers", "5", "--device", "cpu",
                                 "--dtype", "float32"])
    assert r.exit_code != 0 and "--layers 5: expected 1 to 2 for tiny-moe" in r.output
    r = CliRunner().invoke(app, ["bench", "moe", "--shape", "tiny-moe", "--device", "cpu", "--prefill", "four"])
    assert r.exit_code != 0 and "--prefill: expected PROMPTSxTOKENS such as 4x2048, got 'four'" in r.output
