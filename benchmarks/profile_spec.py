"""Where a speculative decode step's time goes on the GPU: a random model of a bench shape, one
sequence of 256 prompt tokens, 64 greedy tokens, k = 1 and 3; each part of ``Speculator.run``
timed with a device sync around it (so the parts add up to a little more than an unsynced step).

    PYTHONPATH=src python benchmarks/profile_spec.py [qwen2.5-1.5b]
"""
import sys
import time

import torch

from opencomposer.inference import speculate
from opencomposer.inference.bench import random_model
from opencomposer.inference.engine import Engine, SamplingParams
from opencomposer.train.mtp import head_for

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-1.5b"
hf = random_model(shape, "cpu", torch.float32)
head = head_for(hf); head.set_draft_vocab(torch.ones(hf.config.vocab_size), 8192)
times = {}
def timed(name, fn):
    def wrap(*a, **k):
        torch.cuda.synchronize(); t = time.perf_counter()
        out = fn(*a, **k)
        torch.cuda.synchronize(); times.setdefault(name, []).append(time.perf_counter() - t)
        return out
    return wrap
for k in (1, 3):
    e = Engine(hf, None, max_model_len=512, max_num_seqs=8, device="cuda", dtype=torch.bfloat16, kv_blocks=400,
               draft=head, num_draft=k)
    g = torch.Generator().manual_seed(0)
    p = [torch.randint(0, 150000, (256,), generator=g).tolist()]
    sp = SamplingParams(max_tokens=64, temperature=0)
    e.generate(p, sp)
    times.clear()
    orig_h, orig_acc, orig_draft = e.runner.hidden_states, speculate._accept, e.speculator._draft
    e.runner.hidden_states = timed("verify (prefill graph)", orig_h)
    speculate._accept = timed("accept", orig_acc)
    e.speculator._draft = timed("draft", orig_draft)
    orig_run = e.speculator.run
    e.speculator.run = timed("speculator.run total", orig_run)
    torch.cuda.synchronize(); t = time.perf_counter()
    e.generate(p, sp)
    wall = time.perf_counter() - t
    speculate._accept = orig_acc
    print(f"k={k} wall {wall*1e3:.1f} ms for 64 tokens, steps {len(times['accept'])}")
    for n, v in times.items():
        v = sorted(v)[len(v)//2]
        print(f"   {n}: median {v*1e3:.3f} ms")
    # GPU-only time of the verify graph: replay alone, timed with events
    st = e.stats()
    print("   prefill graphs:", st["prefill_graph_tokens"][:4])
