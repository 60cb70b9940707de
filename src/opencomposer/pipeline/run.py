"""The whole learning job of `opencomposer train`: tasks -> [CPT] -> SFT warm start -> RL -> evals -> report.

    opencomposer train --config configs/train/demo.toml            # what `make demo` runs
    opencomposer train --config configs/train/demo.toml --resume   # continue a stopped run

Composer's order at small scale: optionally continued pretraining on raw code (``[pretrain]
enabled = true``: ``train/pretrain.py``, whose export every later stage starts from), then
the model learns the tool format from oracle traces (SFT on assistant tokens only), then RL
improves it. Held-out pass@1 is measured on the base model (``[model] name``, before any
stage), after SFT and after RL, through the deployment harness.
The base model is measured last, on a fresh load of its weights (its score does not
depend on when it is taken), so the first RL step comes minutes sooner.
Every stage leaves its result in the run directory (``pretrain/``, ``evals.json``, ``sft.json``,
``sft_model/``, ``checkpoints/``, ``metrics.jsonl``), and a resumed run skips the
stages already done (and continues an interrupted continued pretraining from its checkpoint).
What of it a resume reads, and so what must travel to resume on a fresh machine (the carry
set), is ``pipeline/carry.py``'s; nothing in it names the directory it was written in, so it
resumes under another ``run.out_dir`` too.

Under torchrun, rank 0 makes the tasks, runs the oracle, the evaluations and the report;
every rank takes part in the CPT, SFT and RL updates (sharded, ``train/pretrain.py``, ``rl/run.py``).

Test: ``pytest tests/integration/test_rl_run.py tests/integration/test_pipeline_pretrain.py``.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

from opencomposer.config import ConfigError
from opencomposer.eval.heldout import evaluate
from opencomposer.paths import atomic_write_text
from opencomposer.rl.config import RLRunConfig
from opencomposer.pipeline.report import write_report
from opencomposer.pipeline.warm_start import oracle_traces, sft_warm_start
from opencomposer.rl.run import RLRun, refuse_unsharded_engine
from opencomposer.rl.taskpool import ensure_tasks, split_tasks
from opencomposer.tasks.format import Task
from opencomposer.train import distributed
from opencomposer.train.checkpoint import save_checkpoint
from opencomposer.train.checkpoint_files import CheckpointError
from opencomposer.train.export import export_model
from opencomposer.train.pretrain import run_pretrain_config


def _write_json(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=1))


def continued_pretraining(cfg: RLRunConfig, out: Path, resume: bool, dist: distributed.Dist,
                          log: Callable[[str], None]) -> dict | None:
    """The ``[pretrain]`` stage (``run_pretrain`` into ``out/pretrain``), or None when it is off.

    Resumed and done (``pretrain/result.json`` at ``pretrain.steps``): skipped. Resumed and
    interrupted: ``run_pretrain`` continues from ``pretrain/checkpoints``. Not resumed: it starts
    over, as every stage does. Every rank runs it (sharded under torchrun); rank 0 decides."""
    p = cfg.pretrain
    if not p.enabled:
        return None
    stage = out / "pretrain"

    def done() -> dict | None:
        if resume:
            return pretrain_done(cfg, out)
        shutil.rmtree(stage / "checkpoints", ignore_errors=True)  # a fresh run: an old stage's is not continued
        return None

    res = distributed.on_main(dist, done, "rank 0 could not read the pretrain stage")
    if res is not None:
        log(f"continued pretraining: done ({stage / 'result.json'}), skipped")
        return res
    log(f"continued pretraining of {cfg.model.name}: {p.steps} steps x {p.batch_size} x {p.seq_len} tokens on "
        f"{', '.join(p.data)} ...")
    try:
        res = run_pretrain_config(p.run_config(cfg.model.name, str(stage)), device=cfg.model.device,
                                  progress=bool(distributed.main_does(dist, sys.stderr.isatty)))
    except (CheckpointError, ValueError, FileNotFoundError) as e:  # settings the data or the model refuse
        raise ConfigError(f"[pretrain] stage: {e}") from None
    for name, before in res["before"].items():
        if name != "step":
            log(f"  held-out loss ({name}): {before['loss']} -> {res['after'][name]['loss']}")
    return res


def pretrain_done(cfg: RLRunConfig, out: Path) -> dict | None:
    """The ``[pretrain]`` stage's result when ``out/pretrain`` holds it complete (its steps, its model), else None;
    ``model_dir`` is the model here, wherever the run dir was when it was made."""
    stage = out / "pretrain"
    path = stage / "result.json"
    if path.exists() and (stage / "model").is_dir():
        res = json.loads(path.read_text())
        if res.get("steps") == cfg.pretrain.steps:
            return {**res, "model_dir": str(stage / "model")}
    return None


def pretrain_summary(res: dict) -> dict:
    """What the pipeline's result says of the stage: the model it made and its held-out losses."""
    sets = [k for k in res["before"] if k != "step"]
    return {"model": res["model_dir"], "steps": res["steps"], "resumed_from": res["resumed_from"],
            "loss_before": {k: res["before"][k]["loss"] for k in sets},
            "loss_after": {k: res["after"][k]["loss"] for k in sets}}


def run_pipeline(cfg: RLRunConfig, resume: bool = False, log: Callable[[str], None] = print,
                 on_step: Callable[[dict], None] | None = None) -> dict:
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend = cfg.rollout.backend
    dist = distributed.init_from_env(cfg.model.device)  # a plain process unless started by torchrun
    log = distributed.main_only(dist, lambda: log)  # rank 0 speaks for the run; the others' log does nothing
    refuse_unsharded_engine(cfg, dist)  # what RLRun refuses, refused before any stage runs
    if cfg.pretrain.enabled:
        cfg.pretrain.check_paths()  # before the tasks are made: a typo should not wait for them
    # tasks are made and split once, on rank 0; the other ranks only train
    train, held = distributed.on_main(dist, lambda: split_tasks(ensure_tasks(cfg.tasks, backend, log),
                                                                cfg.tasks.heldout, cfg.tasks.seed, out),
                                      "rank 0 could not make or split the tasks")
    log(f"{len(train)} training tasks, {len(held)} held out; model {cfg.model.name}"
        + (f"; trainer sharded over {dist.world} ranks" if dist.enabled else ""))
    cpt = continued_pretraining(cfg, out, resume, dist, log)
    start_model = cpt["model_dir"] if cpt else cfg.model.name  # SFT, RL and the KL reference start here
    t0 = time.perf_counter()
    run = RLRun(cfg, train, out, resume=resume, on_step=on_step, start_model=start_model)
    log(f"model loaded in {time.perf_counter() - t0:.1f}s" + (f"; resuming at step {run.start_step}" if run.start_step else ""))
    if run.learner.resume_warning:
        log(f"warning: {run.learner.resume_warning}")
    try:
        evals_path, sft_path = out / "evals.json", out / "sft.json"
        evals = json.loads(evals_path.read_text()) if resume and evals_path.exists() else {}
        held_tasks = [Task.load(p) for p in held]

        def measure(name: str) -> None:  # on rank 0 (the actor's side)
            if held_tasks and name in cfg.eval.stages and name not in evals:
                log(f"evaluating held-out pass@1 ({name}) ...")
                with run.actor.make_policy(cfg.eval.temperature, base_model=name == "base") as pol:
                    evals[name] = evaluate(pol, held_tasks, cfg.eval.k, backend, cfg.agent,
                                           save_dir=out / "evals" / name)
                log(f"  {name}: pass@1 {evals[name]['pass@1']:.3f} ({evals[name]['seconds']}s)")
                _write_json(evals_path, evals)

        if run.start_step == 0:
            if cfg.sft.enabled and not (resume and sft_path.exists()):
                log("SFT warm start on oracle traces" + (f", from {start_model}" if cpt else "") + " ...")
                if not resume:  # a new run: nothing of an earlier one's SFT is read back
                    distributed.main_does(dist, lambda: [shutil.rmtree(out / d, ignore_errors=True)
                                                         for d in ("traces", "sft_ckpt")])
                trajs = distributed.on_main(dist, lambda: oracle_traces(train[: cfg.sft.max_traces], backend,
                                                                        out / "traces", cfg),
                                            "rank 0 could not make the oracle traces")
                sft = sft_warm_start(run.learner.trainer, trajs, cfg, log, ckpt_dir=out / "sft_ckpt")
                export_model(out / "sft_model", run.learner.trainer)
                distributed.main_does(dist, lambda: shutil.rmtree(out / "sft_ckpt", ignore_errors=True))
                # a step-0 checkpoint holds the SFT weights, so a run stopped before its first
                # RL checkpoint resumes from them instead of from the base model
                save_checkpoint(run.learner.ckpt_dir, run.learner.trainer, run.actor_state(None) or {}, 0,
                                keep=cfg.run.keep_checkpoints, identity=run.learner.identity,
                                keep_every=cfg.run.keep_every)
                run.refresh_weights()  # the SFT weights, for the evaluation and the first rollouts
                distributed.main_does(dist, lambda: (_write_json(sft_path, sft), measure("sft")))
        log(f"RL: {cfg.run.steps} steps x {cfg.rollout.tasks_per_step} tasks x k={cfg.rollout.k}")
        rows = run.run()

        def finish() -> dict:  # rank 0: the last evaluations and the report
            run.actor.policy.close()
            measure("rl")
            measure("base")
            report = write_report(out)
            return {"out": str(out), "report": str(report),
                    "evals": {k: evals[k]["pass@1"] for k in ("base", "sft", "rl") if k in evals},
                    "steps": len(rows), "last_step": rows[-1] if rows else None,
                    "checkpoint": str(run.learner.latest_checkpoint() or ""),
                    **({"start_model": start_model, "pretrain": pretrain_summary(cpt)} if cpt else {})}

        # the other ranks only trained: their result says so
        return distributed.main_does(dist, finish) or {"out": str(out), "rank": dist.rank,
                                                       "steps": cfg.run.steps - run.start_step}
    finally:
        run.release()  # the Ray actors of [cluster], kept for the evaluations after the last step
