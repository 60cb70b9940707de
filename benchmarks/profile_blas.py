"""cuBLAS at an agent turn's size (GPU): the Qwen2.5-1.5B projections at M = 208, 224, 256
under torch's default BLAS choice, preferred cuBLASLt and preferred cuBLAS.

    PYTHONPATH=src python3 benchmarks/profile_blas.py

Each projection (no bias) runs once per layer on that layer's own random bf16 weight in a
CUDA graph (28 layers: the weights come from HBM), microseconds per layer; one line per
(library, M) with the four projections and their sum. Last line: one JSON object.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opencomposer.inference.batch1_plan import graph_ms
from opencomposer.inference.bench import emit

LAYERS = 28
SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}  # (N, K)


def main() -> None:
    torch.manual_seed(0)
    ws = {r: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
          for r, (n, k) in SHAPES.items()}
    res: dict = {"device": torch.cuda.get_device_name()}
    for lib in ("default", "cublaslt", "cublas"):
        if lib != "default":
            torch.backends.cuda.preferred_blas_library(lib)
        for m in (208, 224, 256):
            row = {}
            for r, (_, k) in SHAPES.items():
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                row[r] = round(1000 * graph_ms(lambda x=x, r=r: [F.linear(x, w) for w in ws[r]]) / LAYERS, 2)
            row["sum"] = round(sum(row.values()), 1)
            res[f"{lib} M={m}"] = row
            print(lib, m, row, flush=True)
    emit(res, None)


if __name__ == "__main__":
    main()
