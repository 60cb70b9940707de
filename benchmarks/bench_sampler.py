"""In-graph sampling cost at decode batch sizes (GPU): ``sampler.sample_plain`` (torch ops,
~8 passes over fp32 copies of the logits) against ``triton_sample.sample_plain_fused`` (two
kernels, one read of the logits), each replayed from a CUDA graph, on Qwen2.5 vocabulary
logits in bf16. The floor is one read of the logits at the measured copy bandwidth.

    PYTHONPATH=src python3 benchmarks/bench_sampler.py [--batches 1,64,256]

Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json

import torch

from opencomposer.inference.engine import batch1_plan
from opencomposer.bench.toolkit import bandwidth
from opencomposer.inference.engine.sampler import sample_plain
from opencomposer.inference.kernels.sample import sample_plain_fused


def graph_ms(fn, args: tuple, reps: int = 50) -> float:
    """Milliseconds per replay of a CUDA graph of ``out.copy_(fn(*args[1:]))``."""
    out, *rest = args
    return batch1_plan.graph_ms(lambda: out.copy_(fn(*rest)), reps=reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--vocab", type=int, default=151936)
    a = ap.parse_args()
    bw = bandwidth("cuda")
    res = {"bench": "sampler", "device": torch.cuda.get_device_name(), "bandwidth_GBps": round(bw / 1e9, 1)}
    for b in map(int, a.batches.split(",")):
        logits = torch.randn(b, a.vocab, device="cuda").to(torch.bfloat16)
        inputs = torch.stack([torch.full((b,), 0.8, device="cuda"), torch.zeros(b, device="cuda")])
        seed = torch.tensor([1], device="cuda")
        out = torch.empty(2, b, dtype=torch.float64, device="cuda")
        t = graph_ms(sample_plain, (out, logits, inputs))
        f = graph_ms(sample_plain_fused, (out, logits, inputs, seed))
        floor = logits.numel() * logits.element_size() / bw * 1e3
        res[f"b{b}"] = {"torch_ms": round(t, 4), "fused_ms": round(f, 4), "speedup": round(t / f, 2),
                        "read_floor_ms": round(floor, 4)}
        print(f"b{b}: torch {t:.3f} ms, fused {f:.3f} ms, floor {floor:.3f} ms", flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
