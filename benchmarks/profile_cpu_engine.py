"""Why the engine's CPU path computes few-row projections as W @ x^T, keeps decoding
sequences' K/V contiguous and samples by inverse CDF: each form timed at SmolLM2-135M's
shapes on this CPU.

* projections: the 30 layers' qkv, o, gate_up and down (each layer its own weights, larger
  than the caches together, as a forward reads them) and the lm_head, at 1-256 rows, as
  ``F.linear(x, W)`` and as ``(W @ x^T)^T`` made contiguous (``models/transformer.Linear``
  takes the second for at most ``FEW_ROWS`` rows);
* decode attention's block gather for 3 sequences of ~1,300 keys: ``k_cache[tables]`` and
  ``k_cache.index_select(0, tables.flatten())``;
* decode attention over 30 layers at batch 1, 4 and 8 on ~1,400-token contexts: gathering
  the blocks every layer (``attention._decode``) against the contiguous copy
  (``decode_mirror.py``, ``attention._decode_mirrored``), outputs compared, and the time to
  read K and V once (``.sum()``, the bandwidth floor);
* sampling a step's tokens from 49,152-entry logits at batch 1-8: the exponential race
  ``argmax(p / E)`` (one random number per entry) against ``sampler.sample_plain``.

    PYTHONPATH=src python benchmarks/profile_cpu_engine.py [--parts decode,sampler] [--out cpu_forms.json]

Milliseconds (projections, decode, sampling) and microseconds (gathers), medians of the
repeats (``inference.bench.time_ms``); the last line is one JSON object.
Results in benchmarks/RESULTS.md (sessions 12 and 14).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from opencomposer.inference.models.attention import _decode, _decode_mirrored, decode_mask
from opencomposer.bench.toolkit import emit, random_model, time_ms
from opencomposer.inference.engine.decode_mirror import DecodeMirror
from opencomposer.inference.models.decoder_config import DecoderConfig

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


class _Seq:
    def __init__(self, n: int, table: list[int]):
        self.n, self.block_table = n, table

    def __len__(self) -> int:
        return self.n


def decode_attention(cfg: DecoderConfig, batches=(1, 4, 8), keys: int = 1400) -> dict:
    out = {}
    for b in batches:
        out[str(b)] = _decode_case(cfg, b, keys)
        print("decode attention, batch", b, out[str(b)], flush=True)
    return out


def _decode_case(cfg: DecoderConfig, b: int, keys: int) -> dict:
    layers, kvh, d, h, bs = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads, 16
    width = -(-keys // bs)
    blocks = b * width + 1
    k_cache, v_cache = torch.randn(layers, blocks, bs, kvh, d), torch.randn(layers, blocks, bs, kvh, d)
    tables = torch.randperm(blocks)[:b * width].view(b, width)
    lens = torch.tensor([keys - 37 * i for i in range(b)])
    seqs = [_Seq(int(n), tables[i].tolist()) for i, n in enumerate(lens)]
    q, k, v = torch.randn(b, h, d), torch.randn(b, kvh, d), torch.randn(b, kvh, d)
    mirror = DecodeMirror(layers, kvh, d, torch.float32, max_len=keys + 256, budget=1 << 40)
    view = mirror.step(seqs, k_cache, v_cache)
    mask = decode_mask(tables, lens, bs, torch.float32)
    slots = tables.gather(1, ((lens - 1) // bs)[:, None])[:, 0] * bs + (lens - 1) % bs
    for i in range(layers):  # the new token's K/V in the paged cache too, as the engine writes it
        k_cache[i].view(-1, kvh, d)[slots], v_cache[i].view(-1, kvh, d)[slots] = k, v

    def gather():
        return [_decode(q, k_cache[i], v_cache[i], tables, mask) for i in range(layers)]

    def mirrored():
        return [_decode_mirrored(q, k, v, view, i) for i in range(layers)]

    def read_once():
        return [(mirror.k[i, :b].sum(), mirror.v[i, :b].sum()) for i in range(layers)]

    diff = max((a - c).abs().max().item() for a, c in zip(gather(), mirrored()))
    assert diff < 1e-4, diff
    res = {"gather_sdpa_ms": time_ms(gather, CPU, 5), "mirror_sdpa_ms": time_ms(mirrored, CPU, 5),
           "read_kv_once_ms": time_ms(read_once, CPU, 5)}
    return {**{n: round(t, 1) for n, t in res.items()}, "max_abs_diff": diff}


def _race(logits, inputs):  # session 13's sampler: argmax(p / E), E ~ Exp(1) per entry
    scaled = logits / inputs[0][:, None]
    drawn = (scaled - torch.empty_like(scaled).exponential_().log_()).argmax(dim=-1)
    chosen = scaled.gather(1, drawn[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)
    return torch.stack([drawn.double(), chosen.double()])


def sampling(vocab: int, batches=(1, 4, 8)) -> dict:
    from opencomposer.inference.engine.sampler import sample_plain

    out = {}
    for b in batches:
        args = (torch.randn(b, vocab) * 3, torch.tensor([[0.8] * b, [0.0] * b]))
        out[str(b)] = {"exponential_race_ms": round(time_ms(lambda a=args: _race(*a), CPU, 30), 2),
                       "inverse_cdf_ms": round(time_ms(lambda a=args: sample_plain(*a), CPU, 30), 2)}
        print("sampling, batch", b, out[str(b)], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,16,64,128,256")
    ap.add_argument("--parts", default="projections,gathers,decode,sampler")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()
    cfg = model_config()
    parts = {"projections": lambda: projections(cfg, tuple(int(r) for r in a.rows.split(","))),
             "gathers": lambda: gathers(cfg), "decode": lambda: decode_attention(cfg),
             "sampler": lambda: sampling(cfg.vocab_size)}
    wanted = a.parts.split(",")
    unknown = [p for p in wanted if p not in parts]
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; expected some of {list(parts)}")
    res = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    res.update({p: parts[p]() for p in wanted})
    emit(res, a.out)


if __name__ == "__main__":
    main()
