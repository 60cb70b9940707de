"""MoE decode benchmark: the engine on a Qwen3-MoE shape against its own experts' loop, Hugging
Face ``generate`` on the same weights, and the memory-bandwidth roofline.

    opencomposer bench moe                                  # Qwen3-30B-A3B's shape, 8 of its 48 layers
    PYTHONPATH=src python -m opencomposer.bench.moe --layers 8 --out moe.json
    PYTHONPATH=src python -m opencomposer.bench.moe --full    # all 48 layers (30.5B), engine only

Decode tokens/s at each batch size (bf16, random weights of the real shape), for
* ``engine``: as it runs by default -- steps of at most ``triton_moe.FUSED_MAX_TOKENS`` tokens
  through three Triton kernels a sparse layer (routing, gate/up, down), larger ones as two
  grouped GEMMs (``torch._grouped_mm``); decode and prefill in CUDA graphs;
* ``engine_grouped``: every step through the grouped GEMMs (what the Triton path replaced);
* ``engine_loop``: the experts as a loop over the experts hit (eager: the loop syncs with the
  host every layer, so no graphs), the fallback where grouped GEMMs do not run;
* ``hf``: ``generate`` with transformers' own experts implementation (its name is recorded);
* ``roofline``: a step reading only what it must -- the dense weights, the experts the
  batch's tokens were routed to (counted from the routes the engine recorded, per layer
  and position) and the K/V -- at the measured copy bandwidth;
* ``parity``: the engine's routes and logprobs against HF's forward pass on the same weights
  (``route_parity``): how often a token's experts differ, and the logprob gap with HF routing
  freely and with the engine's routes replayed;
* ``prefill``: tokens/s of 4 prompts of 2,048 tokens submitted together (the grouped GEMMs;
  HF's forward pass over the same batch beside it when HF is loaded).
``--full`` builds the model at its real depth directly in the engine's own module (the HF
copy it is otherwise loaded from would not fit beside it on one 80 GB GPU) and times the
engine alone. Last line: one JSON object.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from opencomposer.bench.engine import engine_decode, hf_decode, prefill, roofline
from opencomposer.bench.toolkit import _figures, _prompts, _sync, bandwidth, emit
from opencomposer.inference.engine.core import Engine, SamplingParams
from opencomposer.inference.models.decoder_config import DecoderConfig
from opencomposer.inference.models.moe import SparseMoE
from opencomposer.inference.models.transformer import DecoderLM, empty_model

MOE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "norm_topk_prob": True, "vocab_size": 151936, "tie_word_embeddings": False},
    "tiny-moe": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
                 "num_experts_per_tok": 2, "norm_topk_prob": True, "vocab_size": 512, "tie_word_embeddings": True},
}


def moe_config(shape: str, layers: int | None = None):
    from transformers import Qwen3MoeConfig

    if shape not in MOE_SHAPES:
        raise ValueError(f"unknown MoE shape {shape!r}; expected one of {sorted(MOE_SHAPES)}")
    spec = dict(MOE_SHAPES[shape])
    if layers is not None:
        if not 1 <= layers <= spec["num_hidden_layers"]:
            raise ValueError(f"--layers {layers}: expected 1 to {spec['num_hidden_layers']} for {shape}")
        spec["num_hidden_layers"] = layers
    return Qwen3MoeConfig(**spec, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None)


def random_hf(config, device: str, dtype: torch.dtype, seed: int = 0):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the benchmark dtype: an fp32 copy first would double the memory
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def random_engine_model(config, device: str, dtype: torch.dtype, seed: int = 0) -> DecoderLM:
    """The engine's module with random weights, allocated once in ``dtype`` on ``device``."""
    model = empty_model(DecoderConfig.from_hf(config), device, dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, config.initializer_range, generator=g)
    return model.eval()


def experts_hit(engine: Engine, batch: int, prompt_len: int, tokens: int = 16) -> float:
    """Mean distinct experts per sparse layer that one decode step of ``batch`` sequences
    reads, from the routes the engine records (per generated position and layer)."""
    ps = _prompts(batch, prompt_len, engine.model.cfg.vocab_size, 3)
    outs = engine.generate(ps, SamplingParams(max_tokens=tokens, temperature=1.0))
    routes = torch.stack([c.routes[prompt_len:prompt_len + tokens - 1].long() for c in outs])  # [B, pos, L, k]
    b, pos, layers, k = routes.shape
    per = routes.permute(1, 2, 0, 3).reshape(pos * layers, b * k)
    distinct = [len(set(row.tolist())) for row in per]
    return sum(distinct) / len(distinct)


def route_parity(engine: Engine, hf, n: int = 8, prompt_len: int = 128, tokens: int = 32) -> dict[str, float]:
    """The sampler (engine) against the trainer (HF's forward pass) on the same weights: the
    share of (token, sparse layer) pairs whose expert sets differ, and the mean / max
    |logprob difference| of the sampled tokens with HF routing freely and with the engine's
    routes replayed (``models.moe_replay``)."""
    from opencomposer.models.moe_replay import pad_routes, replay_routes

    device = next(hf.parameters()).device
    ps = _prompts(n, prompt_len, engine.model.cfg.vocab_size, 13)
    outs = engine.generate(ps, SamplingParams(max_tokens=tokens, temperature=1.0, seed=3))
    k = hf.config.num_experts_per_tok
    differ = pairs = 0
    gaps: dict[str, list[torch.Tensor]] = {"free": [], "replayed": []}
    with torch.inference_mode():
        for p, c in zip(ps, outs):
            ids = torch.tensor([p + c.token_ids], device=device)
            target = torch.tensor(c.token_ids, device=device)[:, None]
            sampler = torch.tensor(c.logprobs)
            for mode in ("free", "replayed"):
                rec = pad_routes([c.routes], ids.shape[1]).to(device) if mode == "replayed" else None
                with replay_routes(hf, rec):
                    out = hf(ids, output_router_logits=mode == "free")
                lp = torch.log_softmax(out.logits[0, len(p) - 1:-1].float(), -1).gather(1, target)[:, 0].cpu()
                gaps[mode].append((lp - sampler).abs())
                if mode == "free":
                    mine = torch.stack([torch.topk(r.float(), k, -1).indices for r in out.router_logits], 1)[:-1].cpu()
                    differ += int((mine.sort(-1).values != c.routes.long().sort(-1).values).any(-1).sum())
                    pairs += c.routes.shape[0] * c.routes.shape[1]
    free, replayed = torch.cat(gaps["free"]), torch.cat(gaps["replayed"])
    return {"route_pairs": pairs, "routes_differ": differ / pairs, "logprob_diff_mean_free": free.mean().item(),
            "logprob_diff_max_free": free.max().item(), "logprob_diff_mean_replayed": replayed.mean().item(),
            "logprob_diff_max_replayed": replayed.max().item()}


VARIANTS = ("engine", "engine_grouped", "engine_loop", "hf", "parity")


def run(shape: str = "qwen3-30b-a3b", layers: int | None = 8, batches: tuple[int, ...] = (1, 8, 64),
        device: str = "cuda", dtype: str = "bfloat16", prompt_len: int = 256, decode_steps: int = 64,
        full: bool = False, hf_new_tokens: int = 32, variants: tuple[str, ...] = VARIANTS,
        prefill_batch: int = 4, prefill_len: int = 2048, log=print) -> dict[str, Any]:
    bad = sorted(set(variants) - set(VARIANTS))
    if bad or "engine" not in variants:
        raise ValueError(f"variants {list(variants)}: expected 'engine' and any of {list(VARIANTS[1:])}")
    dt = getattr(torch, dtype)
    config = moe_config(shape, None if full else layers)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                              "dtype": dtype, "torch": torch.__version__, "shape": shape,
                              "layers": config.num_hidden_layers, "full_depth": full}
    bw = bandwidth(device)
    result["bandwidth_GBps"] = round(bw / 1e9, 1)
    max_len = max(prompt_len + decode_steps + 32, prefill_len + 8, 128 + 32 + 8)  # decode, prefill, parity
    hf = None
    if full:
        model = random_engine_model(config, device, dt)
    else:
        hf = random_hf(config, device, dt)
        result["hf_experts_implementation"] = str(getattr(hf.config, "_experts_implementation", None) or "eager")
        model = hf
    t = time.perf_counter()
    engine = Engine(model, None, max_num_seqs=max(batches), max_model_len=max_len, device=device, dtype=dt)
    st = engine.stats()
    result["params_B"] = round(sum(p.numel() for p in engine.model.parameters()) / 1e9, 3)
    result["engine_startup_s"] = round(time.perf_counter() - t, 1)
    result["moe_experts"], result["decode_graphs"] = st["moe_experts"], st["cuda_graph_batch_sizes"]
    log(f"{shape} x{config.num_hidden_layers} layers, {result['params_B']}B params: engine {st['moe_experts']}, "
        f"graphs {st['cuda_graph_batch_sizes']}, start-up {result['engine_startup_s']} s")
    for b in batches:
        r: dict[str, Any] = {}
        e = engine_decode(engine, b, prompt_len, decode_steps)
        hit = experts_hit(engine, b, prompt_len)
        e["experts_hit_per_layer"] = hit
        e["roofline_tokens_per_s"] = roofline(engine, b, e["mean_context"], bw, experts_read=hit)
        e["fraction_of_roofline"] = e["tokens_per_s"] / e["roofline_tokens_per_s"]
        r["engine"] = _figures(e)
        result[f"decode_b{b}"] = r
        log(f"b{b} engine: {r['engine']}")
    if hf is not None and "parity" in variants:
        result["parity"] = _figures(route_parity(engine, hf))
        log(f"sampler vs trainer: {result['parity']}")
    if prefill_batch:  # prompts of prefill_len tokens, submitted together; HF's forward pass on the same
        result["prefill"] = _figures(prefill(engine, hf, prefill_batch, prefill_len, device))
        log(f"prefill {prefill_batch} x {prefill_len}: {result['prefill']}")
    assert engine.stats()["kv_blocks_used"] == 0, engine.stats()
    del engine
    if "engine_grouped" in variants and device.startswith("cuda"):
        from opencomposer.inference.kernels import moe as triton_moe
        keep, triton_moe.FUSED_MAX_TOKENS = triton_moe.FUSED_MAX_TOKENS, 0  # read when the graphs are captured
        try:
            grouped = Engine(model, None, max_num_seqs=max(batches), max_model_len=max_len, device=device, dtype=dt)
        finally:
            triton_moe.FUSED_MAX_TOKENS = keep
        for b in batches:
            r = result[f"decode_b{b}"]
            r["engine_grouped"] = _figures(engine_decode(grouped, b, prompt_len, decode_steps))
            r["speedup_vs_grouped"] = round(r["engine"]["tokens_per_s"] / r["engine_grouped"]["tokens_per_s"], 2)
            log(f"b{b} engine, grouped GEMMs only: {r['engine_grouped']}")
        del grouped
    if not full and "engine_loop" in variants:
        loop = Engine(hf, None, max_num_seqs=max(batches), max_model_len=max_len, device=device, dtype=dt,
                      cuda_graphs=False)
        loop.model.use_grouped_mm(False)
        for m in loop.model.modules():  # and not the few-token Triton path either: the loop alone
            if isinstance(m, SparseMoE):
                m.fused = False
        for b in batches:
            r = result[f"decode_b{b}"]
            r["engine_loop"] = _figures(engine_decode(loop, b, prompt_len, max(8, decode_steps // 4)))
            log(f"b{b} engine, experts' loop: {r['engine_loop']}")
        del loop
        for b in batches:
            r = result[f"decode_b{b}"]
            r["speedup_vs_loop"] = round(r["engine"]["tokens_per_s"] / r["engine_loop"]["tokens_per_s"], 2)
    if not full and "hf" in variants:
        for b in batches:
            r = result[f"decode_b{b}"]
            r["hf"] = _figures(hf_decode(hf, b, prompt_len, hf_new_tokens, device))
            r["speedup_vs_hf"] = round(r["engine"]["tokens_per_s"] / r["hf"]["tokens_per_s"], 2)
            log(f"b{b} HF generate: {r['hf']}")
    _sync(device)
    return result


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(MOE_SHAPES))
    ap.add_argument("--layers", type=int, default=8, help="layers of the shape to build (with HF beside it)")
    ap.add_argument("--full", action="store_true", help="every layer, engine only")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--prefill", default="4x2048", help="prompts x tokens prefilled together (0x0: none)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="engine plus any of the others")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    res = run(a.shape, a.layers, tuple(int(b) for b in a.batches.split(",")), a.device, a.dtype, a.prompt_len,
              a.decode_steps, a.full, variants=tuple(a.variants.split(",")),
              prefill_batch=int(a.prefill.split("x")[0]), prefill_len=int(a.prefill.split("x")[1]))
    emit(res, a.out)


if __name__ == "__main__":
    main()
