"""A GRPO group's first turn: k rollouts of one task submitted together, prefill seconds and
tokens computed (the prompt's full blocks are computed once and shared within the step).

    PYTHONPATH=src python benchmarks/bench_group_prefill.py [--model smollm2-135m] [--k 4] [--prompt-len 600]

The engine on this machine's default device (the CPU here), a random ``--prompt-len``-token
prompt, ``--reps`` runs on an empty prefix cache. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import os

import torch

from opencomposer.bench.toolkit import emit
from opencomposer.inference.engine.core import Engine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    torch.manual_seed(0)
    engine = Engine.from_name(a.model, max_num_seqs=max(8, a.k), max_model_len=a.prompt_len + 64)
    vocab = engine.model.cfg.vocab_size
    prompt = torch.randint(100, vocab - 100, (a.prompt_len,)).tolist()
    engine.generate([prompt[:50]], SamplingParams(max_tokens=1))  # warm-up
    runs = []
    for _ in range(a.reps):
        engine.blocks.invalidate()
        s0 = engine.stats()
        engine.generate([prompt] * a.k, SamplingParams(max_tokens=1))
        s1 = engine.stats()
        runs.append({"prefill_s": round(s1["prefill_seconds"] - s0["prefill_seconds"], 3),
                     "tokens_computed": s1["prefill_tokens_computed"] - s0["prefill_tokens_computed"]})
    emit({"model": a.model, "k": a.k, "prompt_len": a.prompt_len, "device": str(engine.device), "runs": runs,
          "loadavg": os.getloadavg()[0]}, None)


if __name__ == "__main__":
    main()
