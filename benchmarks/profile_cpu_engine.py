"""Why the engine's CPU path computes few-row projections as W @ x^T and gathers KV blocks
with ``index_select``: both forms timed at SmolLM2-135M's shapes on this CPU.

* projections: the 30 layers' qkv, o, gate_up and down (each layer its own weights, larger
  than the caches together, as a forward reads them) and the lm_head, at 1-256 rows, as
  ``F.linear(x, W)`` and as ``(W @ x^T)^T`` made contiguous (``models/transformer.Linear``
  takes the second for at most ``FEW_ROWS`` rows);
* decode attention's block gather for 3 sequences of ~1,300 keys: ``k_cache[tables]`` and
  ``k_cache.index_select(0, tables.flatten())``.

    PYTHONPATH=src python benchmarks/profile_cpu_engine.py [--out cpu_forms.json]   # ~2 min

Milliseconds (projections) and microseconds (gathers); the last line is one JSON object.
Results in benchmarks/RESULTS.md (session 12).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from opencomposer.inference.bench import SHAPES, emit


def _time(fn, reps: int) -> float:
    """Seconds per call (after two untimed calls)."""
    for _ in range(2):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def projections(rows: tuple[int, ...]) -> dict:
    s = SHAPES["smollm2-135m"]
    h, inter, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    head = h // s["num_attention_heads"]
    shapes = {"qkv": ((s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * head, h), "o": (h, h),
              "gate_up": (2 * inter, h), "down": (h, inter)}
    weights = {n: [torch.randn(*nk) for _ in range(layers)] for n, nk in shapes.items()}
    lm_head = torch.randn(s["vocab_size"], h)
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

        out[str(m)] = {"layers_linear_ms": 1e3 * _time(lambda f=linear: all_layers(f), reps),
                       "layers_mm_t_ms": 1e3 * _time(lambda f=mm_t: all_layers(f), reps),
                       "lm_head_linear_ms": 1e3 * _time(lambda x=xs["o"]: linear(x, lm_head), reps),
                       "lm_head_mm_t_ms": 1e3 * _time(lambda x=xs["o"]: mm_t(x, lm_head), reps)}
        out[str(m)] = {k: round(v, 1) for k, v in out[str(m)].items()}
        print(m, out[str(m)], flush=True)
    return out


def gathers() -> dict:
    s = SHAPES["smollm2-135m"]
    kvh, d, bs = s["num_key_value_heads"], s["hidden_size"] // s["num_attention_heads"], 16
    b, keys, n = 3, 1300, 4000
    cache = torch.randn(n, bs, kvh, d)
    tables = torch.randperm(n - 1)[:b * -(-keys // bs)].view(b, -1)
    flat = tables.reshape(-1)
    assert torch.equal(cache[tables].reshape(-1), cache.index_select(0, flat).reshape(-1))
    return {"advanced_index_us": round(1e6 * _time(lambda: cache[tables], 200), 1),
            "index_select_us": round(1e6 * _time(lambda: cache.index_select(0, flat), 200), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,16,64,128,256")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()
    res = {"threads": torch.get_num_threads(), "torch": torch.__version__,
           "projections": projections(tuple(int(r) for r in a.rows.split(","))), "gather_k": gathers()}
    emit(res, a.out)


if __name__ == "__main__":
    main()
