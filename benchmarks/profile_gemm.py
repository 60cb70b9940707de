"""The projections of a short prefill step (GPU): cuBLAS against ``triton_gemm`` (split-K).

    PYTHONPATH=src python3 benchmarks/profile_gemm.py [--shapes qwen2.5-1.5b,qwen2.5-0.5b] [--m 224]

For each shape and M, each projection (qkv with its bias, o, gate_up, down) runs once per
layer on that layer's own random bf16 weights inside a CUDA graph (as a prefill graph runs
them, so the weights come from HBM, not L2): cuBLAS (``F.linear``) and every
``triton_gemm.candidates`` config. Microseconds per layer, the HBM-read limit of the
weight, the best config and its largest difference from cuBLAS. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from opencomposer.inference.batch1_plan import graph_ms
from opencomposer.inference.bench import SHAPES, bandwidth, emit
from opencomposer.inference.triton_gemm import candidates, gemm


def roles(c: dict) -> dict[str, tuple[int, int, bool]]:
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    return {"qkv": ((heads + 2 * kv) * d, h, True), "o": (h, heads * d, False),
            "gate_up": (2 * c["intermediate_size"], h, False), "down": (h, c["intermediate_size"], False)}


def one_shape(shape: str, ms: list[int], bw: float) -> dict:
    c = SHAPES[shape]
    layers = c["num_hidden_layers"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {}
    for role, (n, k, has_bias) in roles(c).items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        bs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None for _ in range(layers)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            res = {"hbm_limit_us": round(n * k * 2 / bw * 1e6, 2), "NK": [n, k]}
            res["cublas"] = round(1000 * graph_ms(lambda x=x, ws=ws, bs=bs: [F.linear(x, w, b) for w, b in zip(ws, bs)]) / layers, 2)
            best = ("cublas", res["cublas"])
            for cfg in candidates(m, n, k, sms):
                key = "x".join(map(str, cfg))
                try:
                    us = 1000 * graph_ms(lambda cfg=cfg, x=x, ws=ws, bs=bs: [gemm(x, w, b, config=cfg)
                                                                                 for w, b in zip(ws, bs)]) / layers
                except (RuntimeError, triton.runtime.errors.OutOfResources) as e:
                    res[key] = type(e).__name__
                    continue
                res[key] = round(us, 2)
                if us < best[1]:
                    best = (key, us)
            res["best"] = best[0]
            if best[0] != "cublas":
                cfg = tuple(int(v) for v in best[0].split("x"))
                ref = F.linear(x, ws[0], bs[0]).float()
                res["best_max_abs_diff"] = float((gemm(x, ws[0], bs[0], config=cfg).float() - ref).abs().max())
                res["ref_max_abs"] = float(ref.abs().max())
            out[f"{role} M={m}"] = res
            print(shape, role, m, json.dumps({k2: v for k2, v in res.items() if k2 in
                                              ("cublas", "best", "hbm_limit_us")} | {"best_us": round(best[1], 2)}),
                  flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-0.5b")
    ap.add_argument("--m", default="224")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bw = bandwidth("cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "bandwidth_GBps": round(bw / 1e9, 1)}
    ms = [int(v) for v in a.m.split(",")]
    for shape in a.shapes.split(","):
        res[shape] = one_shape(shape, ms, bw)
    emit(res, a.out)


if __name__ == "__main__":
    main()
