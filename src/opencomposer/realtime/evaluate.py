"""The eval half of the gate: a checkpoint (model dir or name) -> ``run_suite`` results.

    res = evaluate_checkpoint("runs/rt/candidates/cycle-0002", "cycle-0002", cfg, out_dir)

The checkpoint is loaded fresh and run through the suite of ``[gate]`` with the same
harness that serves and trains it: the built-in engine (``gate.engine = "builtin"``) or
transformers ``generate`` (``"hf"``), behind ``policies.batched.BatchedPolicy`` so a suite's
episodes share the model (the engine: continuously). ``gate_decision`` then applies ``eval.gate.compare``.

Test: ``pytest tests/integration/test_realtime_cycle.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opencomposer.realtime.config import RealtimeConfig


def checkpoint_policy(path: str, cfg: RealtimeConfig):
    """The gate's sampler on a fresh load of ``path``: engine or HF ``generate``, batched."""
    from opencomposer.models.registry import load_model
    from opencomposer.policies import make_policy

    g = cfg.gate
    model, tok = load_model(path, device=cfg.model.device)
    sampling = {"temperature": g.temperature, "max_new_tokens": g.max_new_tokens, "seed": cfg.run.seed,
                "batch": g.max_batch, "name": str(path)}
    if g.engine == "builtin":
        from opencomposer.inference.engine.core import Engine

        engine = Engine.for_agents(model, tok, max_num_seqs=g.max_batch, device=cfg.model.device)
        return make_policy("engine", engine=engine, **sampling)
    return make_policy("model", model=(model, tok), **sampling)


def evaluate_checkpoint(path: str, label: str, cfg: RealtimeConfig, out_dir: Path) -> dict[str, Any]:
    from opencomposer.eval.run import run_suite
    from opencomposer.eval.suite import load_suite

    suite = load_suite(cfg.gate.suite)
    with checkpoint_policy(path, cfg) as policy:
        return run_suite(suite, policy, k=cfg.gate.k, backend=cfg.gate.backend, agent_cfg=cfg.agent, label=label,
                         out_dir=out_dir, progress=False)


def gate_decision(current: dict | Path, candidate: dict | Path, cfg: RealtimeConfig) -> dict[str, Any]:
    from opencomposer.eval.gate import compare

    g = cfg.gate
    return compare(current, candidate, metric=g.metric, tolerance=g.tolerance, n_boot=g.n_boot,
                   seed=cfg.run.seed, strict=g.strict).to_dict()
