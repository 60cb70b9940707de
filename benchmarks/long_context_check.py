"""The engine against Hugging Face on a context-extended model at long prompts (issue 32).

    python benchmarks/long_context_check.py --model runs/longctx/model --data /usr/lib/python3.12 \
        --lengths 7000 16000 30000 --new-tokens 16 --device cuda

A model extended by ``opencomposer pretrain --context-factor N`` carries YaRN RoPE scaling in its
config; the builtin engine reads it (``inference/models/decoder_config.py``), HF's model applies its
own implementation. Prompts: the first ``L`` tokens of the data's ``.py`` files joined in path order
(the same text each run). For each length: HF's greedy tokens (``generate``, no sampling) and the
engine's (temperature 0), both in the same dtype on the same device; printed per length: tokens
equal, the first position that differs and HF's top-2 logit margin there (in bf16 a near-tie can
flip between two correct implementations; a wrong RoPE differs from the first token with a wide
margin). Last line: one JSON object.

Test: ``pytest tests/bench/test_long_context_check.py`` (tiny-random, CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from opencomposer.inference.engine.core import Engine
from opencomposer.inference.engine.sequence import SamplingParams
from opencomposer.models.registry import load_model
from opencomposer.train.long_context import native_context, rope_parameters


def corpus_tokens(data: Path, tokenizer, need: int) -> list[int]:
    """At least ``need`` tokens of the ``.py`` files under ``data`` (path order), or all there are."""
    files = sorted(data.rglob("*.py")) if data.is_dir() else [data]
    ids: list[int] = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            break
    return ids


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF's greedy continuation and the top-2 logit margin at each of its positions."""
    dev = next(model.parameters()).device
    out = model.generate(torch.tensor([prompt], device=dev), attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                         device=dev), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = []
    for s in out.scores:
        top = torch.topk(s[0].float(), 2).values
        margins.append(round(float(top[0] - top[1]), 4))
    return tokens, margins


def check(model_name: str, data: Path, lengths: list[int], new_tokens: int, device: str, dtype: torch.dtype,
          log=print) -> dict:
    hf, tok = load_model(model_name, dtype=dtype, device=device)
    ctx = int(hf.config.max_position_embeddings)
    longest = max(lengths) + new_tokens
    if longest > ctx:
        raise SystemExit(f"--lengths: {max(lengths)} + {new_tokens} new tokens = {longest} is past the model's context "
                         f"{ctx} ({model_name}: rope {rope_parameters(hf.config)['rope_type']})")
    ids = corpus_tokens(data, tok, max(lengths))
    if len(ids) < max(lengths):
        raise SystemExit(f"--data {data}: {len(ids)} tokens of .py files, fewer than the longest prompt {max(lengths)}")
    engine = Engine(hf, None, max_num_seqs=1, max_model_len=longest, device=device, dtype=dtype)
    rows = []
    for n in lengths:
        prompt = ids[:n]
        t0 = time.perf_counter()
        ref, margins = hf_greedy(hf, prompt, new_tokens)
        t_hf = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = engine.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0))[0].token_ids
        t_engine = time.perf_counter() - t0
        first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        row = {"prompt_tokens": n, "equal": sum(a == b for a, b in zip(ref, got)), "of": len(ref),
               "first_difference": first, "margin_there": margins[first] if first is not None else None,
               "min_margin": min(margins), "hf_s": round(t_hf, 2), "engine_s": round(t_engine, 2)}
        log(f"{n:>6} prompt tokens: {row['equal']}/{len(ref)} greedy tokens equal"
            + (f", first difference at {first} (HF's top-2 margin there {row['margin_there']})" if first is not None else ""))
        rows.append(row)
    rope = rope_parameters(hf.config)
    return {"check": "long_context", "model": model_name, "device": device, "dtype": str(dtype).split(".")[-1],
            "rope_type": rope["rope_type"], "factor": rope.get("factor"), "native_context": native_context(hf.config),
            "context": ctx, "new_tokens": new_tokens, "rows": rows,
            "all_equal": all(r["first_difference"] is None for r in rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a model directory (an extended one) or a registry name")
    ap.add_argument("--data", type=Path, required=True, help="a directory of .py files (or one file): the prompts' text")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096], help="prompt lengths in tokens")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="default: bfloat16 on CUDA, float32 on the CPU")
    a = ap.parse_args(argv)
    if min(a.lengths) < 1 or a.new_tokens < 1:
        ap.error("--lengths and --new-tokens must be positive")
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"))
    res = check(a.model, a.data, a.lengths, a.new_tokens, a.device, dtype, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
