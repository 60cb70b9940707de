"""Where a speculative decode step's time goes on the GPU (``spec_graph.py``): a random model of
a bench shape, one sequence of 256 prompt tokens, 64 new tokens, greedy and T = 1, k = 1 and 3.

Per setting: the step's wall time (``decode_seconds`` / steps), the GPU time of its two graphs
replayed alone (verify = the decode graph of k + 1 rows; accept + draft), the host's share
(the rest), and the accept + draft graph's kernels by GPU time (torch profiler, 20 replays).

    PYTHONPATH=src python benchmarks/profile_spec.py [--shape qwen2.5-1.5b] [--top 12]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from opencomposer.inference.engine.batch1_plan import replay_ms
from opencomposer.bench.toolkit import random_model
from opencomposer.inference.engine.core import Engine, SamplingParams
from opencomposer.train.mtp import head_for


def kernels(g: torch.cuda.CUDAGraph, reps: int = 20, top: int = 12) -> list[tuple[str, float]]:
    """The graph's kernels by GPU microseconds a replay (largest first)."""
    from torch.profiler import ProfilerActivity, profile

    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    us: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us[ev.name[:70]] += ev.device_time / reps
    return sorted(((n, round(t, 2)) for n, t in us.items()), key=lambda x: -x[1])[:top]


class _Timed:
    """Wraps a callable (or a graph's ``replay``) to record the host time at each call's start and end."""

    def __init__(self, fn, log: list, name: str):
        self.fn, self.log, self.name = fn, log, name

    def __call__(self, *a, **kw):
        import time

        self.log.append((self.name, "in", time.perf_counter()))
        out = self.fn(*a, **kw)
        self.log.append((self.name, "out", time.perf_counter()))
        return out

    def replay(self):
        import time

        self.log.append((self.name, "in", time.perf_counter()))
        self.fn.replay()
        self.log.append((self.name, "out", time.perf_counter()))


def host_parts(e: Engine, prompt: list, sp: SamplingParams) -> dict[str, float]:
    """Median host microseconds of a speculative step's parts: from ``step()``'s start to the
    verify's input building (schedule, drafts' room), building and launching the verify,
    the accept graph's launch up to the results on the host (mostly waiting for the GPU),
    and from there to the step's end (tokens appended, outputs)."""
    import statistics

    log: list = []
    spec, runner = e.speculator, e.runner
    runner_rows, step, run = runner.decode_rows, e.step, spec.graphs.run
    graphs = dict(spec.graphs.graphs)
    runner.decode_rows = _Timed(runner_rows, log, "verify")
    spec.graphs.graphs = {key: _Timed(g, log, "accept") for key, g in graphs.items()}
    spec.graphs.run = _Timed(run, log, "run")
    e.step = _Timed(step, log, "step")
    try:
        e.generate(prompt, sp)
    finally:
        runner.decode_rows, e.step, spec.graphs.graphs, spec.graphs.run = runner_rows, step, graphs, run
    parts: dict[str, list[float]] = {"before verify": [], "verify inputs + launch": [], "accept launch -> results": [],
                                     "after results": []}
    marks: dict = {}
    for name, edge, t in log:
        marks[name, edge] = t
        if (name, edge) == ("step", "out") and ("verify", "in") in marks and marks["verify", "in"] > marks["step", "in"]:
            parts["before verify"].append(marks["verify", "in"] - marks["step", "in"])
            parts["verify inputs + launch"].append(marks["verify", "out"] - marks["verify", "in"])
            parts["accept launch -> results"].append(marks["run", "out"] - marks["accept", "in"])
            parts["after results"].append(marks["step", "out"] - marks["run", "out"])
    return {k: round(1e6 * statistics.median(v), 1) for k, v in parts.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    hf = random_model(a.shape, "cpu", torch.float32)
    head = head_for(hf)
    head.set_draft_vocab(torch.ones(hf.config.vocab_size), 8192)
    g = torch.Generator().manual_seed(0)
    prompt = [torch.randint(0, hf.config.vocab_size, (256,), generator=g).tolist()]
    out = {"shape": a.shape, "device": torch.cuda.get_device_name(), "rows": []}
    plain = Engine(hf, None, max_model_len=512, max_num_seqs=8, device="cuda", dtype=torch.bfloat16, kv_blocks=400)
    out["decode_b1_graph_ms"] = round(replay_ms(plain.runner.graphs[1], 50), 4)
    for k in (1, 3):
        e = Engine(hf, None, max_model_len=512, max_num_seqs=8, device="cuda", dtype=torch.bfloat16, kv_blocks=400,
                   draft=head, num_draft=k)
        for temp in (0.0, 1.0):
            sp = SamplingParams(max_tokens=64, temperature=temp)
            e.generate(prompt, sp)
            before = e.stats()
            e.generate(prompt, sp)
            st = e.stats()
            steps = st["steps"] - before["steps"] - 1  # one prefill step
            step_ms = 1e3 * (st["decode_seconds"] - before["decode_seconds"]) / steps
            verify = replay_ms(e.runner.graphs[e.runner.decode_bucket(k + 1)], 50)
            graph = e.speculator.graphs.graphs[1, temp != 0]
            accept = replay_ms(graph, 50)
            out["rows"].append({"k": k, "temperature": temp, "step_ms": round(step_ms, 4),
                                "verify_graph_ms": round(verify, 4), "accept_draft_graph_ms": round(accept, 4),
                                "host_ms": round(step_ms - verify - accept, 4),
                                "graph_steps": st["spec_graph_steps"] - before["spec_graph_steps"],
                                "host_us": host_parts(e, prompt, sp),
                                "accept_draft_kernels_us": kernels(graph, top=a.top)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
