"""Why the engine's CPU path computes few-row projections as W @ x^T and gathers KV blocks
with ``index_select``: both forms timed at SmolLM2-135M's shapes on this CPU.

* projections: the 30 layers' qkv, o, gate_up and down (each layer its own weights, larger
  than the caches together, as a forward reads them) and the lm_head, at 1-256 rows, as
  ``F.linear(x, W)`` and as ``(W @ x^T)^T`` made contiguous (``models/transformer.Linear``
  takes the second for at most ``FEW_ROWS`` rows);
* decode attention's block gather for 3 sequences of ~1,300 keys: ``k_cache[tables]`` and
  ``k_cache.index_select(0, tables.flatten())``.

    PYTHONPATH=src python benchmarks/profile_cpu_engine.py [--out cpu_forms.json]   # ~2 min

Milliseconds (projections) and microseconds (gathers), medians of the repeats
(``inference.bench.time_ms``); the last line is one JSON object.
Results in benchmarks/RESULTS.md (session 12).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from opencomposer.inference.bench import emit, random_model, time_ms
from opencomposer.inference.models.transformer import DecoderConfig

CPU = torch.device("cpu")


def model_config() -> DecoderConfig:
    """The engine's config of the embedded model's shape (its projections' shapes, heads)."""
    return DecoderConfig.from_hf(random_model("smollm2-135m", "cpu", torch.float32).config)


def projections(cfg: DecoderConfig, rows: tuple[int, ...]) -> dict:
    shapes = cfg.projection_shapes()  # role -> (N, K)
    lm_head = torch.randn(*shapes.pop("lm_head"))
    layers = cfg.num_layers
    weights = {n: [torch.randn(*nk) for _ in range(layers)] for n, nk in shapes.items()}
    linear = lambda x, w: F.linear(x, w)
    mm_t = lambda x, w: torch.mm(w, x.t()).t().contiguous()
    out = {}
    for m in rows:
        xs = {n: torch.randn(m, nk[1]) for n, nk in shapes.items()}
        reps = 5 if m < 64 else 2

        def all_layers(f, xs=xs):
            for i in range(layers):
                for n in shapes:
                    f(xs[n], weights[n][i])

        out[str(m)] = {"layers_linear_ms": time_ms(lambda f=linear: all_layers(f), CPU, reps),
                       "layers_mm_t_ms": time_ms(lambda f=mm_t: all_layers(f), CPU, reps),
                       "lm_head_linear_ms": time_ms(lambda x=xs["o"]: linear(x, lm_head), CPU, reps),
                       "lm_head_mm_t_ms": time_ms(lambda x=xs["o"]: mm_t(x, lm_head), CPU, reps)}
        out[str(m)] = {k: round(v, 1) for k, v in out[str(m)].items()}
        print(m, out[str(m)], flush=True)
    return out


def gathers(cfg: DecoderConfig) -> dict:
    kvh, d, bs = cfg.num_kv_heads, cfg.head_dim, 16
    b, keys, n = 3, 1300, 4000
    cache = torch.randn(n, bs, kvh, d)
    tables = torch.randperm(n - 1)[:b * -(-keys // bs)].view(b, -1)
    flat = tables.reshape(-1)
    assert torch.equal(cache[tables].reshape(-1), cache.index_select(0, flat).reshape(-1))
    return {"advanced_index_us": round(1e3 * time_ms(lambda: cache[tables], CPU, 200), 1),
            "index_select_us": round(1e3 * time_ms(lambda: cache.index_select(0, flat), CPU, 200), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,16,64,128,256")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()
    cfg = model_config()
    res = {"threads": torch.get_num_threads(), "torch": torch.__version__,
           "projections": projections(cfg, tuple(int(r) for r in a.rows.split(","))), "gather_k": gathers(cfg)}
    emit(res, a.out)


if __name__ == "__main__":
    main()
