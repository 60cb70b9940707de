"""Host work of a decode step at an RL rollout's batch and context, on the CPU: what the engine
does around the decode graph's replay (``Engine._plain_step`` -> ``ModelRunner._decode``),
timed part by part, without running the model.

    PYTHONPATH=src python3 benchmarks/bench_decode_host.py [--batch 88] [--context 3000] [--max-model-len 8192]

An engine with the decode graphs' buffers (``cuda_graphs="eager"``: the CUDA path's host side)
holds ``--batch`` running sequences of ``--context`` tokens each (their blocks allocated, no
K/V computed: nothing here reads it). Per part, the median of ``--reps`` calls (ms):

* ``schedule``: ``Scheduler.schedule()`` of the decode step;
* ``inputs_lists``: the graph inputs as the engine built them before (nested lists of the
  tables padded to ``max_model_len``, then ``torch.tensor``); ``inputs_numpy``: as it builds
  them now (``ModelRunner._rows_of``, in place in the host buffers);
* ``uniforms_seeded``: every row's uniform drawn from its own seeded generator (RL rollouts
  seed every request; on CUDA these were two kernel launches a row before, now one copy);
* ``postprocess``: each row's stop check and block publish (``Engine._append``'s work).

The H200 box's CPU is ~2-3x faster than a small cloud VM's. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch

from opencomposer.bench.toolkit import random_model, time_ms
from opencomposer.inference.engine.core import Engine, SamplingParams
from opencomposer.inference.engine.outputs import stop_reason
from opencomposer.inference.engine.sampler import uniforms
from opencomposer.inference.engine.sequence import Sequence, Status


def decode_host(batch: int, context: int, max_model_len: int, reps: int) -> dict:
    bs = 16
    blocks = batch * (-(-(context + 8) // bs)) + max_model_len // bs
    # SmolLM2-135M's heads and vocabulary, one narrow layer: the host work is the same
    model = random_model("smollm2-135m", "cpu", torch.float32, num_hidden_layers=1, intermediate_size=64)
    engine = Engine(model, None, max_num_seqs=batch, max_model_len=max_model_len,
                    kv_blocks=blocks, block_size=bs, cuda_graphs="eager")
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(batch):  # running, every token but the last computed: the state before a decode step
        s = Sequence(f"r{i}", torch.randint(0, 49152, (context,), generator=g).tolist(),
                     SamplingParams(max_tokens=64, temperature=1.0, seed=i))
        assert engine.blocks.allocate(s)
        s.num_computed, s.status = context - 1, Status.RUNNING
        engine.scheduler.running.append(s)
        seqs.append(s)
    runner, sch = engine.runner, engine.scheduler
    batch_ = sch.schedule()
    bucket = runner.decode_bucket(batch)

    def lists():
        ids, pos, slots, tables, lens = runner._decode_inputs(batch_, runner.max_blocks_per_seq, bucket)
        torch.tensor([ids, pos, slots, lens], dtype=torch.long)
        torch.tensor(tables, dtype=torch.long)

    def post():
        for s in seqs:
            stop_reason(s, engine.eos_ids, None, max_model_len)
            engine.blocks.publish(s)

    cpu = torch.device("cpu")
    out = {"batch": batch, "context": context, "max_model_len": max_model_len, "bucket": bucket,
           "table_width": runner.max_blocks_per_seq}
    for name, fn in (("schedule", sch.schedule), ("inputs_lists", lists),
                     ("inputs_numpy", lambda: runner._rows_of(seqs, bucket)),
                     ("uniforms_seeded", lambda: uniforms(seqs, 1, cpu)), ("postprocess", post)):
        out[f"{name}_ms"] = round(time_ms(fn, cpu, reps), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=88)
    ap.add_argument("--context", default="3000", help="comma-separated")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    res = [decode_host(a.batch, int(c), a.max_model_len, a.reps) for c in a.context.split(",")]
    for r in res:
        print(r, flush=True)
    print(json.dumps({"decode_host": res}))


if __name__ == "__main__":
    main()
