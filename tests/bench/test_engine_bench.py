"""``bench engine`` end to end on the tiny shape (CPU): every figure present, nothing leaked."""

from __future__ import annotations

import json
import sys

import pytest

from opencomposer.bench.engine import run


def test_bench_engine_tiny_cpu():
    res = run(["tiny"], device="cpu", dtype="float32", batches=(1, 4), hf_batches=(1,), prompt_len=8, decode_steps=3,
              prefill_batch=2, prefill_len=16, rollout={"system": 40, "reply": 4, "tool": 8}, log=lambda *a: None)
    json.dumps(res)
    tiny = res["tiny"]
    # start-up: no graphs on the CPU, so nothing captured and no graph memory
    assert tiny["startup"]["seconds"] > 0 and tiny["startup"]["parts_s"] == {}
    assert tiny["startup"]["graph_memory_MiB"] == 0 and tiny["startup"]["prefill_graphs"] == 0
    assert res["parity"]["float32"]["mean_abs_diff"] < 1e-3 and res["parity"]["float32"]["greedy_identical"] == "4/4"
    for b in (1, 4):
        d = tiny[f"decode_b{b}"]
        assert d["tokens_per_s"] > 0 and 0 < d["fraction_of_roofline"]
        assert d["tokens_per_s_min"] <= d["tokens_per_s"] <= d["tokens_per_s_max"]  # median of the step windows
    assert tiny["hf_decode_b1"]["tokens_per_s"] > 0 and tiny["speedup_vs_hf_b1"] > 0
    pc = tiny["prefix_cache_10_turns"]
    # each turn recomputes only what is new: the whole rollout costs about its last prompt
    assert pc["last_prompt_tokens"] == 40 + 9 * (4 + 8)
    assert pc["ratio_tokens"] <= 1.5 and pc["cache_hit_tokens"] > 0
    # the same rollout's GEMMs alone, and the floor: positive times, ratios of 10 steps to 1
    assert pc["gemm_only_total_ms"] > 0 and pc["gemm_only_alone_ms"] > 0 and pc["weights_read_ms"] > 0
    assert pc["ratio_gemm_only"] == pytest.approx(pc["gemm_only_total_ms"] / pc["gemm_only_alone_ms"], rel=0.02)
    assert 0 < pc["ratio_floor"] <= 10
    group = tiny["prefix_cache_10_turns_x2"]  # two rollouts in lockstep: each turn's prompts in one step
    assert group["concurrent"] == 2 and group["last_prompt_tokens"] == 2 * (40 + 9 * (4 + 8))
    assert group["ratio_tokens"] <= 1.5 and group["cache_hit_tokens"] > 0
    same = tiny["prefix_cache_10_turns_x2_same_task"]  # a GRPO group: one first prompt, computed once
    # the second rollout reuses the first's full blocks of the 40-token first prompt
    assert same["same_task"] and same["total_prefill_tokens"] <= group["total_prefill_tokens"] - 40 // 16 * 16


def test_bench_engine_defaults_to_the_tiny_shape_in_fp32_without_a_gpu():
    from opencomposer.cli.bench import engine_defaults
    from opencomposer.bench.toolkit import SHAPES

    assert engine_defaults("cpu", None, None) == ("tiny", "1,8", "float32")
    assert engine_defaults("cuda", None, None) == ("qwen2.5-0.5b,qwen2.5-1.5b", "1,64,256", "bfloat16")
    assert engine_defaults("cuda:1", None, None)[0] == "qwen2.5-0.5b,qwen2.5-1.5b"
    # what was asked wins
    assert engine_defaults("cpu", "smollm2-135m", "1", "bfloat16") == ("smollm2-135m", "1", "bfloat16")
    assert all(s in SHAPES for s in engine_defaults("cuda", None, None)[0].split(","))


def test_bench_engine_names_a_bad_shape_dtype_or_batch_list():
    from typer.testing import CliRunner

    from opencomposer.cli import app

    runner = CliRunner()
    for args, expect in ((["--shapes", "qwen9"], "unknown shape(s) ['qwen9']"),
                         (["--dtype", "float16"], "--dtype: expected bfloat16 or float32, got 'float16'"),
                         (["--batches", "1,x"], "--batches: expected comma-separated integers")):
        r = runner.invoke(app, ["bench", "engine", "--device", "cpu", *args])
        assert r.exit_code != 0
        assert expect in json.loads(r.stdout.strip().splitlines()[-1])["error"], r.stdout


def test_the_embedded_models_shape_is_a_llama_of_its_size():
    import torch

    from opencomposer.bench.toolkit import random_model

    m = random_model("smollm2-135m", "cpu", torch.float32)
    assert type(m).__name__ == "LlamaForCausalLM"
    assert round(sum(p.numel() for p in m.parameters()) / 1e6, 1) == 134.5  # SmolLM2-135M's count (tied head)
    with pytest.raises(ValueError, match="unknown shape 'x'"):
        random_model("x", "cpu", torch.float32)


@pytest.mark.parametrize("graphs, seeded", [(True, True), ("eager", False), ("eager", True)])
def test_bench_engine_times_decode_at_the_contexts_asked(graphs, seeded):
    # the CPU default (eager decode), and the decode graphs' path run eagerly: plain rows run
    # ahead, seeded ones (as an RL rollout's) sample outside the graph
    # (and, once, beside a busy Python thread: an RL actor's episode threads)
    busy = int(graphs == "eager" and seeded)
    before = sys.getswitchinterval()  # Python's 5 ms, or what an RL engine built earlier in this process set
    res = run(["tiny"], device="cpu", dtype="float32", batches=(3,), decode_steps=4, contexts=(8, 40),
              seeded=seeded, decode_only=True, phase_steps=2, cuda_graphs=graphs, busy_threads=busy,
              switch_ms=1.0 if busy else None, log=lambda *a: None)
    json.dumps(res)
    tiny = res["tiny"]
    assert tiny["busy_threads"] == busy and sys.getswitchinterval() == pytest.approx(before)  # restored
    assert "parity" not in res and "prefill" not in tiny and "hf_decode_b3" not in tiny  # decode only
    assert tiny["seeded"] is seeded and tiny["max_model_len"] == 40 + 4 + 2 + 8
    for c in (8, 40):
        d = tiny[f"decode_b3_ctx{c}"]
        assert d["context"] == c and c < d["mean_context"] < c + 4 + 4
        assert d["steps_timed"] == 4 and d["tokens_timed"] == 3 * 4  # one token a sequence a step
        assert d["tokens_per_s"] > 0 and d["step_ms"] > 0
        parts = [d[f"phase_{k}_ms"] for k in ("schedule", "run_host", "run_device", "sample", "other")]
        assert all(p >= 0 for p in parts[:4]) and sum(parts) == pytest.approx(d["phase_step_ms"], rel=0.01)
        assert (d["phase_sample_ms"] > 0) == (seeded or graphs is True)  # plain graph rows sample inside it
        assert ("graph_replay_ms" in d) == (graphs == "eager")  # the bucket's graph (4 rows) replayed alone


def test_bench_engine_names_a_bad_context_list_and_a_too_short_engine():
    from typer.testing import CliRunner

    from opencomposer.cli import app

    r = CliRunner().invoke(app, ["bench", "engine", "--device", "cpu", "--context", "8,x"])
    assert r.exit_code != 0
    assert "--context: expected comma-separated integers" in json.loads(r.stdout.strip().splitlines()[-1])["error"]
    with pytest.raises(ValueError, match="max_model_len=32 cannot hold a context of 40 tokens"):
        run(["tiny"], device="cpu", dtype="float32", batches=(1,), contexts=(40,), decode_only=True,
            max_model_len=32, log=lambda *a: None)
