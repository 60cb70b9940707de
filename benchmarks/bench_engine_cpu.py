"""The rollout engine on this machine's CPU, at the embedded default model's shape.

SmolLM2-135M's shape (a Llama: 30 layers, hidden 576, random weights) in fp32, as ``make
demo`` runs it: decode at batch 1, 4 and 8 on 1,024-token prompts (an agent turn's context
in the demo is 1,200-1,700 tokens) against Hugging Face ``generate`` at the same batches,
prefill, and the 10-turn agent rollout with the prefix cache -- ``inference/bench.run`` at
CPU sizes (``opencomposer bench engine`` times the GPU sizes).

    PYTHONPATH=src python benchmarks/bench_engine_cpu.py --out cpu.json   # ~10 min on 2 cores

The last line printed is one JSON object with every figure; results in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse

import torch

from opencomposer.bench.engine import run
from opencomposer.bench.toolkit import emit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()
    batches = tuple(int(b) for b in a.batches.split(","))
    res = run(["smollm2-135m"], "cpu", "float32", batches, hf_batches=batches, prompt_len=a.prompt_len,
              decode_steps=a.decode_steps, prefill_batch=2, prefill_len=1024,
              rollout={"turns": 10, "system": 1000, "reply": 64, "tool": 200, "repeats": 1})
    res["threads"] = torch.get_num_threads()
    emit(res, a.out)


if __name__ == "__main__":
    main()
