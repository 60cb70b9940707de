"""Host work of an agent turn's prefill step, on the CPU: what runs before the prefill
graph's replay is called (``Engine._plain_step`` -> ``ModelRunner._prefill_triton`` ->
``_prefill_replay``), timed function by function.

    PYTHONPATH=src python3 benchmarks/bench_prefill_host.py [--prefix 1200,3000] [--new 208] [--reps 400]

The prefill graphs exist only on CUDA, but their host side does not need them: an engine on
the CPU (a small random Qwen2 with Qwen2.5-1.5B's 6 query heads per KV head) holds a
``--prefix``-token history in its prefix cache, and a turn of ``--new`` more tokens is
scheduled and laid out as the graph path would. Per phase, the median of ``--reps`` calls
(ms):

* ``schedule``: ``Scheduler.schedule()`` admitting the turn (prefix-cache lookup of the
  prompt's full blocks -- through the line the history left when it finished, then hashing
  the rest -- and block allocation), undone after each call; ``schedule_branch``:
  the same for turns that differ in their new tokens (as retries of one turn);
* ``prefill_inputs``: ``ModelRunner._prefill_inputs`` (token ids, positions, slots, tables);
* ``pick``: ``triton_prefill.pick_variant``, which of the bucket's graphs (tile, key splits)
  the step replays, among those a CUDA engine of this context captures (H100: 132 SMs);
* ``plan``: ``triton_prefill.plan`` for the picked tile;
* ``fill``: ``PrefillLayout.fill``, the graph input buffer's host array;
* ``host_total``: the four after ``schedule`` in a row, plus the sampling key.

The H100 box's CPU is ~2-3x faster than a small cloud VM's. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from opencomposer.bench.toolkit import time_ms
from opencomposer.inference.engine.core import Engine, SamplingParams
from opencomposer.inference.engine.prefill_layout import PrefillLayout
from opencomposer.inference.engine.sampler import plain_inputs
from opencomposer.inference.engine.sequence import Sequence


def small_qwen2(max_len: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=4096, hidden_size=192, intermediate_size=384, num_hidden_layers=1,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=max_len,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def median_ms(fn, reps: int) -> float:
    return round(time_ms(fn, torch.device("cpu"), reps), 4)


def turn(engine: Engine, prefix: int, new: int, reps: int) -> dict:
    vocab = engine.model.cfg.vocab_size
    g = torch.Generator().manual_seed(prefix)
    engine.blocks.invalidate()
    history = torch.randint(0, vocab, (prefix,), generator=g).tolist()
    [done] = engine.generate([history], SamplingParams(max_tokens=1))
    prompt = history + done.token_ids + torch.randint(0, vocab, (new,), generator=g).tolist()
    sched, runner = engine.scheduler, engine.runner
    params = SamplingParams(max_tokens=1)

    def schedule_ms(prompts) -> float:
        times = []
        for p in prompts:
            seq = Sequence("turn", p, params)
            sched.add(seq)
            t = time.perf_counter()
            sched.schedule()
            times.append(time.perf_counter() - t)
            sched.finish(seq)
        return round(1e3 * statistics.median(times), 4)

    # the same turn again and again; and turns that branch off the history (new tokens each time)
    tails = [torch.randint(0, vocab, (new,), generator=g).tolist() for _ in range(reps)]
    out = {"cached_tokens": 0, "new_tokens": 0, "schedule": schedule_ms([prompt] * reps),
           "schedule_branch": schedule_ms([history + done.token_ids + t for t in tails])}
    seq = Sequence("turn", prompt, params)
    sched.add(seq)
    batch = sched.schedule()
    out["cached_tokens"], out["new_tokens"] = seq.num_computed, batch.chunks[0]
    inputs = runner._prefill_inputs(batch)
    spans = inputs[4]
    bucket = runner.prefill_bucket(len(inputs[0]))
    lay = PrefillLayout(runner.max_blocks_per_seq, runner.group, runner.scratch_block, runner.block_size,
                        runner.prefill_buckets, runner.prefill_seqs)  # the engine's own layout
    captured = runner.graph_variants(elem_bytes=2)[bucket]  # the graphs a bf16 engine of this context captures

    def pick(spans):  # the runner's own pick on CUDA
        return runner._graph_variant(bucket, spans, captured, elem_bytes=2)

    rows = pick(spans)[0].rows

    def planned():
        return runner._tiles(spans, rows)

    tiles, seqs = planned()

    def host():
        ids, pos, slots, last, spans = runner._prefill_inputs(batch)
        tiles, seqs = runner._tiles(spans, pick(spans)[0].rows)
        lay.fill(ids, pos, slots, last, [sp[3] for sp in spans], seqs, tiles)
        sampling = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        return (len(sampling), *map(tuple, plain_inputs(sampling)))

    out["prefill_inputs"] = median_ms(lambda: runner._prefill_inputs(batch), reps)
    out["plan"] = median_ms(planned, reps)
    out["pick"] = median_ms(lambda: pick(spans), reps)
    out["fill"] = median_ms(lambda: lay.fill(*inputs[:4], [sp[3] for sp in spans], seqs, tiles), reps)
    out["host_total"] = median_ms(host, reps)
    sched.finish(seq)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", default="1200,3000")
    ap.add_argument("--new", type=int, default=208)
    ap.add_argument("--reps", type=int, default=400)
    a = ap.parse_args()
    torch.set_num_threads(1)
    max_len = max(int(p) for p in a.prefix.split(",")) + a.new + 64
    engine = Engine(small_qwen2(max_len), None, max_num_seqs=8, max_model_len=max_len, device="cpu",
                    dtype=torch.float32, max_num_batched_tokens=8192)
    res = {"loadavg": os.getloadavg()[0], "reps": a.reps,
           "turn": {p: turn(engine, int(p), a.new, a.reps) for p in a.prefix.split(",")}}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
