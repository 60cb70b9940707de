"""``opencomposer bench spec``: speculative decoding with an MTP head against plain decoding.

    opencomposer bench spec --head runs/mtp/head                     # the embedded model, CPU
    opencomposer bench spec --shape qwen2.5-1.5b --device cuda       # step costs, random weights
    PYTHONPATH=src python -m opencomposer.bench.spec --head runs/mtp/head

With a model and its trained head (``--model``, ``--head``): prompts are the first
``prompt_len`` tokens of held-out source files (by default the Python standard library's,
code the head never saw); each prompt continues for ``max_tokens`` tokens on a plain
engine and on speculative engines (``--num-draft`` each), at every temperature and batch
size asked for. Per setting: generated tokens/s (wall time of ``Engine.generate`` after a
warm-up run), decode steps, tokens per decode step, the share of drafted tokens kept, and
at temperature 0 how many sequences came out token-for-token equal to plain decoding's
(speculation is exact; a near-tie flipped by the verify step's different summation order
is the only way to differ). Baseline: the plain engine, same run, same prompts.

With ``--shape`` (a randomly initialised model, e.g. on a GPU, where the embedded model
cannot travel): a random head keeps almost nothing, so only the cost of one speculative
step against a plain decode step is measured (verify ``k + 1`` tokens a sequence, then
draft ``k``): a head that keeps ``a`` tokens a step on average speeds decoding up by
``(1 + a) / (that ratio)``. The last line printed is one JSON object.
"""

from __future__ import annotations

import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

from opencomposer.bench.toolkit import emit, random_model
from opencomposer.inference.engine.core import Engine, SamplingParams


def code_prompts(tokenizer: Any, n: int, length: int, source: str | Path | None = None) -> list[list[int]]:
    """The first ``length`` tokens of ``n`` source files (sorted, every k-th, >= length tokens)."""
    root = Path(source or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    out: list[list[int]] = []
    step = max(1, len(files) // (4 * n))
    for f in files[::step]:
        ids = tokenizer.encode(f.read_text(errors="replace")[:8 * length])
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            return out
    raise ValueError(f"{root}: found {len(out)} Python files of >= {length} tokens; need {n}")


def _timed(engine: Engine, prompts: list[list[int]], params: SamplingParams, batch: int) -> tuple[dict, list]:
    engine.generate(prompts[:batch], params)  # warm-up: allocations, caches
    before = dict(engine.stats())
    engine.blocks.invalidate()  # no prefix reuse from the warm-up beyond what the run itself makes
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += engine.generate(prompts[i:i + batch], params)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    seconds = time.perf_counter() - t0
    st = engine.stats()
    tokens = sum(len(c.token_ids) for c in outs)
    steps = st["steps"] - before["steps"]
    decode_steps = steps - -(-len(prompts) // batch)  # one prefill step a group of prompts (<= the step budget)
    decode_s = st["decode_seconds"] - before["decode_seconds"]
    row = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
           "decode_steps": decode_steps, "decode_step_ms": round(1e3 * decode_s / max(decode_steps, 1), 3)}
    if "spec_draft_tokens" in st:
        row["graph_steps"] = st["spec_graph_steps"] - before["spec_graph_steps"]
        drafted = st["spec_draft_tokens"] - before["spec_draft_tokens"]
        kept = st["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        # a sequence's decode tokens (its first comes from the prefill) over the steps it took
        decoded = tokens - len(outs)
        row.update(drafted=drafted, kept=kept, kept_share=round(kept / drafted, 4) if drafted else None,
                   tokens_per_sequence_step=round(decoded / max(decoded - kept, 1), 3))
    return row, outs


def _graph_parts(plain: Engine, speculative: dict[int, Engine], batches: tuple[int, ...]) -> dict[str, float]:
    """GPU milliseconds of each graph a step replays, alone (after the timed runs: the replays
    reuse the last step's inputs): the plain decode graph of b rows, and per k the verify
    graph of b x (k + 1) rows and the accept-and-draft graphs (``spec_graph.py``)."""
    from opencomposer.inference.engine.batch1_plan import replay_ms

    out = {}
    for b in batches:
        out[f"decode b{b}"] = round(replay_ms(plain.runner.graphs[plain.runner.decode_bucket(b)], 50), 4)
        for k, eng in speculative.items():
            bucket = eng.runner.decode_bucket(b * (k + 1))
            if bucket is not None:
                out[f"k={k} b{b} verify ({bucket} rows)"] = round(replay_ms(eng.runner.graphs[bucket], 50), 4)
            for sampled in (False, True):
                g = eng.speculator.graphs.graphs.get((b, sampled)) if eng.speculator.graphs else None
                if g is not None:
                    out[f"k={k} b{b} accept+draft {'sampled' if sampled else 'greedy'}"] = round(replay_ms(g, 50), 4)
    return out


def run(model: str = "smollm2-135m", head: str | None = None, shape: str | None = None, device: str = "cpu",
        dtype: str = "float32", num_draft: tuple[int, ...] = (1, 2, 3, 4), batches: tuple[int, ...] = (1, 8),
        temperatures: tuple[float, ...] = (0.0, 1.0), prompts: int = 8, prompt_len: int = 128,
        max_tokens: int = 96, source: str | None = None, draft_vocab: int = 8192) -> dict[str, Any]:
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    if shape:
        from opencomposer.train.mtp import head_for

        hf, tok = random_model(shape, "cpu", torch.float32), None
        head_obj = head_for(hf)
        vocab = hf.config.vocab_size
        head_obj.set_draft_vocab(torch.ones(vocab), draft_vocab)  # as a trained head drafts: from part of it
        g = torch.Generator().manual_seed(0)
        plist = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
        label = f"random {shape}"
    else:
        from opencomposer.models import load_model

        if not head:
            raise ValueError("bench spec: --head DIR (an MTP head of --model, from `opencomposer train-mtp`), "
                             "or --shape for step costs on a random model")
        hf, tok = load_model(model, dtype=torch.float32)
        head_obj = head
        plist = code_prompts(tok, prompts, prompt_len, source)
        label = model
    max_len = prompt_len + max_tokens + 32
    common = {"max_model_len": max_len, "max_num_seqs": max(batches), "device": device, "dtype": dt,
              "kv_blocks": 2 * max(batches) * -(-max_len // 16) + 16}  # several engines share the device
    plain = Engine(hf, tok, **common)
    speculative = {k: Engine(hf, tok, draft=head_obj, num_draft=k, spec_max_batch=max(batches), **common)
                   for k in num_draft}  # speculating at every batch size asked for
    rows = []
    for temp in temperatures:
        params = SamplingParams(max_tokens=max_tokens, temperature=temp)
        for b in batches:
            base, base_out = _timed(plain, plist, params, b)
            rows.append({"engine": "plain", "temperature": temp, "batch": b, **base})
            for k, eng in speculative.items():
                r, out = _timed(eng, plist, params, b)
                r["speedup"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
                r["step_cost_vs_plain"] = round(r["decode_step_ms"] / base["decode_step_ms"], 3)
                if temp == 0:
                    r["greedy_identical"] = sum(a.token_ids == c.token_ids for a, c in zip(base_out, out))
                rows.append({"engine": f"spec k={k}", "temperature": temp, "batch": b, **r})
    graphs = _graph_parts(plain, speculative, batches) if plain.runner.graphs and plain.device.type == "cuda" else None
    return {"bench": "spec", "model": label, "graph_ms": graphs, "head": str(head) if head and not shape else "random",
            "device": str(plain.device), "dtype": dtype, "torch_threads": torch.get_num_threads(),
            "prompts": len(plist), "prompt_len": prompt_len, "max_tokens": max_tokens, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default=None)
    ap.add_argument("--shape", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--num-draft", default="1,2,3,4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--source", default=None, help="prompts from this directory's .py files (default: the stdlib)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    emit(run(a.model, a.head, a.shape, a.device, dtype, tuple(int(x) for x in a.num_draft.split(",")),
             tuple(int(x) for x in a.batches.split(",")), tuple(float(x) for x in a.temperatures.split(",")),
             a.prompts, a.prompt_len, a.max_tokens, a.source), a.out)


if __name__ == "__main__":
    main()
