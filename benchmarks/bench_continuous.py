"""Batch vs continuous ``BatchedPolicy`` over one engine: N concurrent multi-turn episodes.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_continuous.py --episodes 16 --turns 3

Each episode is a thread doing ``turns`` assistant turns (``policy.act`` on a growing
conversation), sleeping ``tool_s`` between turns as a tool would. Turn lengths vary as
in real rollouts: besides the model's own stop tokens, ``--stop-every`` of the vocabulary
ends a turn too (on tiny-random, which samples near-uniformly, a turn then runs about
``stop_every`` tokens on average, capped by ``--max-new-tokens``). Both modes run in the
same process on the same engine and seeds; prints one JSON line: episodes/s, generated
tokens/s and mean sequences per engine step (continuous) or per batch.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from opencomposer.inference.engine.core import Engine
from opencomposer.models.registry import load_model
from opencomposer.policies.batched import BatchedPolicy
from opencomposer.policies.engine import EnginePolicy
from opencomposer.protocols import Message


def episode(policy: BatchedPolicy, i: int, turns: int, tool_s: float, tokens: list[int]) -> None:
    messages = [Message("system", "You are a coding agent."), Message("user", f"Task {i}: fix the bug. " * (1 + i % 5))]
    with policy.episode():
        for _ in range(turns):
            out = policy.act(messages, [])
            tokens[i] += len(out.token_ids)
            messages += [Message("assistant", out.text), Message("user", "ok")]
            time.sleep(tool_s)


def run(policy: BatchedPolicy, n: int, turns: int, tool_s: float) -> dict:
    tokens = [0] * n
    t0 = time.perf_counter()
    threads = [threading.Thread(target=episode, args=(policy, i, turns, tool_s, tokens)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 2), "episodes_per_s": round(n / wall, 3), "tokens": sum(tokens),
            "tokens_per_s": round(sum(tokens) / wall, 1), "mean_running": round(policy.mean_running, 2),
            "generate_s": round(policy.stats["generate_seconds"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--stop-every", type=int, default=32)
    ap.add_argument("--tool-s", type=float, default=0.05)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    hf, tok = load_model(a.model)
    engine = Engine(hf, tok, max_num_seqs=a.episodes, max_model_len=1024, device=a.device)
    engine.eos_ids = frozenset(engine.eos_ids) | frozenset(range(0, hf.config.vocab_size, a.stop_every))
    result = {"model": a.model, "episodes": a.episodes, "turns": a.turns, "max_new_tokens": a.max_new_tokens,
              "stop_every": a.stop_every, "tool_s": a.tool_s}
    for mode in ("batch", "continuous"):
        inner = EnginePolicy(engine, temperature=1.0, max_new_tokens=a.max_new_tokens, seed=0)
        with BatchedPolicy(inner, max_batch=a.episodes, continuous=mode == "continuous") as policy:
            result[mode] = run(policy, a.episodes, a.turns, a.tool_s)
    result["speedup_tokens_per_s"] = round(result["continuous"]["tokens_per_s"] / result["batch"]["tokens_per_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
