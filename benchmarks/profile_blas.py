"""GEMM libraries at an agent turn's size (GPU): a model shape's projections at M = 208, 224,
256 under torch's default BLAS choice, preferred cuBLASLt, preferred cuBLAS, and (with
``--inductor``) the kernel torch.compile's max-autotune picks for each shape among cuBLAS and
its Triton GEMM templates (persistent TMA ones included).

    PYTHONPATH=src python3 benchmarks/profile_blas.py [--shape qwen2.5-1.5b] [--inductor]

On a randomly initialised ``DecoderLM`` of the shape in bf16, ``bench.projection_ms``: each
projection (qkv with its bias, o, gate_up, down) over all layers, each on its own weights,
in a CUDA graph, and the lm_head at one row; microseconds per layer (the lm_head: per call),
one line per (library, M) with their sum. Last line: one JSON object.
"""

from __future__ import annotations

import argparse

import torch

from opencomposer.bench.engine import projection_ms
from opencomposer.bench.toolkit import emit, random_model
from opencomposer.inference.models.transformer import from_hf_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--inductor", action="store_true", help="also time max-autotune's pick (compiles: minutes)")
    a = ap.parse_args()
    model = from_hf_model(random_model(a.shape, "cuda", torch.bfloat16))
    layers = model.cfg.num_layers
    res: dict = {"device": torch.cuda.get_device_name(), "shape": a.shape}
    libs = ["default", "cublaslt", "cublas"] + (["inductor"] if a.inductor else [])
    for lib in libs:
        linear = torch.nn.functional.linear
        if lib == "inductor":
            import torch._inductor.config as inductor

            torch.backends.cuda.preferred_blas_library("default")
            inductor.triton.enable_persistent_tma_matmul = True
            linear = torch.compile(linear, mode="max-autotune-no-cudagraphs", dynamic=False)
        elif lib != "default":
            torch.backends.cuda.preferred_blas_library(lib)
        for m in (208, 224, 256):
            ms = projection_ms(model, m, linear=linear)
            row = {r: round(1000 * v / (1 if r == "lm_head" else layers), 2) for r, v in ms.items()}
            row["layer_sum"] = round(sum(v for r, v in row.items() if r != "lm_head"), 1)
            res[f"{lib} M={m}"] = row
            print(lib, m, row, flush=True)
    emit(res, None)


if __name__ == "__main__":
    main()
