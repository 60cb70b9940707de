"""The GIL convoy on the engine's host path: RL's seeded sampling, alone and beside busy Python threads.

Every torch call lets go of the interpreter and must win it back; while another thread runs Python
that takes up to the switch interval (``sys.setswitchinterval``, 5 ms by default). An RL rollout's
engine thread steps beside the episodes' threads, so the torch calls of a step multiply that wait.
This times ``sampler.uniforms`` (the seeded rows' random numbers) and ``sampler.sample`` (a whole
seeded step's sampling) for ``--rows`` seeded rows: alone, then beside ``--busy`` pure-Python
threads (``bench.engine.python_load``) at each ``--switch-ms`` (0: Python's own interval).

    python benchmarks/bench_gil_convoy.py --rows 88 --vocab 512 --busy 1 --switch-ms 0 0.5 0.1

Last line: one JSON object, milliseconds a call.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from opencomposer.bench.engine import python_load
from opencomposer.inference.engine import sampler
from opencomposer.inference.engine.sequence import SamplingParams, Sequence


def per_call_ms(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return round(1000 * (time.perf_counter() - t0) / calls, 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=88, help="seeded rows (an RL rollout step's ~88)")
    ap.add_argument("--vocab", type=int, default=512, help="logits width (small: the calls, not the math, are timed)")
    ap.add_argument("--busy", type=int, default=1, help="pure-Python threads beside it")
    ap.add_argument("--switch-ms", type=float, nargs="+", default=[0.0, 0.5, 0.1],
                    help="switch intervals to try beside the busy threads (0: Python's own)")
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args(argv)
    if a.rows < 1 or a.vocab < 2 or a.busy < 0 or a.calls < 1 or any(s < 0 for s in a.switch_ms):
        raise SystemExit("need --rows >= 1, --vocab >= 2, --busy >= 0, --calls >= 1 and --switch-ms >= 0")
    seqs = [Sequence(str(i), [1, 2, 3], SamplingParams(seed=1000 + i)) for i in range(a.rows)]
    logits = torch.randn(a.rows, a.vocab)
    cpu = torch.device("cpu")
    uniforms = lambda: sampler.uniforms(seqs, 1, cpu)  # noqa: E731
    sample = lambda: sampler.sample(logits, seqs)  # noqa: E731
    out = {"rows": a.rows, "vocab": a.vocab, "busy_threads": a.busy, "calls": a.calls,
           "alone": {"uniforms_ms": per_call_ms(uniforms, a.calls), "sample_ms": per_call_ms(sample, a.calls)}}
    for s in a.switch_ms:
        with python_load(a.busy, s or None):
            time.sleep(0.05)  # the busy threads running before the clock starts
            out[f"busy_switch_{s or 'default'}"] = {"uniforms_ms": per_call_ms(uniforms, a.calls),
                                                    "sample_ms": per_call_ms(sample, a.calls)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
