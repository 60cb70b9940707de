"""Where a MoE decode step spends its time (GPU): kernels of one decode-graph replay.

    PYTHONPATH=src python3 benchmarks/profile_moe.py [--layers 8] [--batches 1,8] [--out moe_profile.json]

On Qwen3-30B-A3B's shape (random weights, bf16, ``--layers`` of its 48), for each batch size:
the step's wall time and graph replay (``bench.engine_decode``), and a kernel table of one
replay from ``torch.profiler`` (``profile_engine.kernel_table``: name, calls, microseconds),
with the grouped GEMMs' share and their read rate (the bytes of the experts hit over their
time). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_engine import kernel_table

from opencomposer.bench.engine import engine_decode, roofline
from opencomposer.bench.toolkit import bandwidth, emit
from opencomposer.bench.moe import (
    experts_hit,
    moe_config,
    random_engine_model,
)
from opencomposer.inference.engine.core import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    config = moe_config("qwen3-30b-a3b", a.layers)
    model = random_engine_model(config, "cuda", torch.bfloat16)
    batches = [int(b) for b in a.batches.split(",")]
    engine = Engine(model, None, max_num_seqs=max(batches), max_model_len=512)
    bw = bandwidth("cuda")
    cfg = engine.model.cfg
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    out = {"device": torch.cuda.get_device_name(), "layers": a.layers, "bandwidth_GBps": round(bw / 1e9, 1)}
    for b in batches:
        d = engine_decode(engine, b, 256, 32)
        hit = experts_hit(engine, b, 256)
        # replay the batch's graph as the last decode step left it
        engine_decode(engine, b, 256, 4)
        table = kernel_table(engine.runner.graphs[b].replay, top=24)
        grouped = sum(us for name, _, us in table["top"] if "grouped" in name.lower() or "cutlass" in name.lower())
        out[f"b{b}"] = {"step_ms": round(d["step_ms"], 3), "replay_ms": round(d.get("graph_replay_ms", 0), 3),
                        "experts_hit_per_layer": hit,
                        "roofline_ms": round(1000 * b / roofline(engine, b, d["mean_context"], bw, experts_read=hit), 3),
                        "grouped_gemm_us": round(grouped, 1),
                        "grouped_gemm_GBps": round(hit * a.layers * expert_bytes / (grouped * 1e-6) / 1e9, 1)
                        if grouped else None,
                        **table}
        print(f"b{b}: step {d['step_ms']:.3f} ms, replay {d.get('graph_replay_ms', 0):.3f} ms", flush=True)
        for name, calls, us in table["top"]:
            print(f"   {us:9.1f} us {calls:5d}x  {name}", flush=True)
    emit(out, a.out)


if __name__ == "__main__":
    main()
