"""The carry set of a run: the few files of its run directory that ``--resume`` needs, so a run
continues on a fresh machine from what came back of the last one (at most 64 MiB a command).

    paths = carry_state(out, cfg)                  # relative paths under out, each file or directory
    summary = copy_carry(out, dest, cfg)            # them, copied to dest: {"files", "bytes", "fits", ...}
    python -m opencomposer.pipeline.carry OUT DEST [--config C]   # the same; one JSON line last

then, on the fresh machine: ``opencomposer train --config C --out DEST --resume``.

What a resumed ``opencomposer train`` reads from its run directory (``pipeline/run.py``), and so
what the carry set holds:

* ``checkpoints/latest`` and the one step directory it names (not the older ones): the
  weights (LoRA: the adapter's two files alone, ``train.lora``; the tokenizer saved beside them is
  the base model's, loaded with it), AdamW state, RNG states, the learning-rate
  schedule, the actor's state (task sampler, the rollout policy's seed position, the step's
  metrics row) and the run's identity (``rl/learner.py``: a checkpoint of another model, task
  pool or seed is refused);
* ``split.json`` (the held-out split: never train on a held-out task), ``metrics.jsonl`` (the rows
  so far; the report is rebuilt from it), ``evals.json`` (evaluations done, not run again),
  ``sft.json`` (the SFT stage is done: its weights are in the step-0 or a later checkpoint);
* ``sft_model/`` only when full fine-tuning with a KL term (``loss.kl_coef > 0``): the KL reference
  is reloaded from it (LoRA's reference is the base model with the adapters off);
* ``pretrain/result.json`` and ``pretrain/model/`` when a ``[pretrain]`` stage is done (every later
  stage starts from that export), else the stage's latest checkpoint;
* ``factory_tasks/`` when harder tasks were made (``tasks.harder_every``): they are in the pool.

Not carried, as a resume does not read them or makes them again: the older checkpoints,
``tb/`` (TensorBoard, from the rows), ``traces/`` (oracle transcripts for SFT, done),
``evals/`` (the evaluations' transcripts; their figures are in ``evals.json``), ``report.*``
(rebuilt at the end), the tasks (``tasks.dir``: made again from their sources; the identity's
task pool fingerprint says whether they are the same) and a ``[sync]`` weight store (the
followers' copy: a resumed publisher starts its timeline with a full snapshot).

Sizes (``docs/learning.md``): SmolLM2-135M with LoRA r=16 carries a few MiB; full fine-tuning's
weights and AdamW state are over 1 GiB, so LoRA is the carried path.

Test: ``pytest tests/integration/test_resume_carried.py tests/unit/train/test_resume_identity.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from opencomposer.train.checkpoint import resolve_checkpoint
from opencomposer.train.checkpoint_files import LATEST, CheckpointError, read_meta

CARRY_LIMIT = 64 << 20  # bytes a command of the device machine brings back
FILES = ("split.json", "metrics.jsonl", "evals.json", "sft.json")
ADAPTER = ("adapter_model.safetensors", "adapter_config.json")  # what a LoRA checkpoint's model/ must keep


def carry_state(out: str | Path, cfg: Any | None = None) -> list[Path]:
    """The carry set of the run directory ``out``: paths relative to it, each an existing file
    or directory, that a resume on a fresh machine needs (the module docstring says which).
    ``cfg`` (an ``RLRunConfig``) says whether the KL reference is read from ``sft_model/``;
    without it, ``sft_model/`` goes whenever the checkpoint is full fine-tuning."""
    out = Path(out)
    paths: list[Path] = []
    ckpts = out / "checkpoints"
    lora = None
    if (ckpts / LATEST).is_file():
        step = resolve_checkpoint(ckpts)
        meta = read_meta(step)
        lora = bool(meta.get("lora"))
        paths.append(Path("checkpoints") / LATEST)
        if lora and meta.get("layout", "full") == "full":  # the adapter; the tokenizer is the base model's
            paths += [f.relative_to(out) for f in sorted(step.iterdir())
                      if f.is_file() or f.name != "model"]
            paths += [(step / "model" / f).relative_to(out) for f in ADAPTER if (step / "model" / f).is_file()]
        else:
            paths.append(step.relative_to(out))
    paths += [Path(f) for f in FILES if (out / f).is_file()]
    needs_reference = (not lora) if cfg is None else (cfg.loss.kl_coef != 0 and not cfg.train.lora)
    if lora is not None and needs_reference and (out / "sft_model").is_dir():
        paths.append(Path("sft_model"))
    stage = out / "pretrain"
    if (stage / "result.json").is_file() and (stage / "model").is_dir():
        paths += [Path("pretrain/result.json"), Path("pretrain/model")]
    elif (stage / "checkpoints" / LATEST).is_file():
        paths += [Path("pretrain/checkpoints") / LATEST, resolve_checkpoint(stage / "checkpoints").relative_to(out)]
    if (out / "factory_tasks").is_dir():
        paths.append(Path("factory_tasks"))
    return paths


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def copy_carry(out: str | Path, dest: str | Path, cfg: Any | None = None) -> dict[str, Any]:
    """Copy ``out``'s carry set into ``dest`` (made; must not be ``out`` or inside it), under the
    same relative paths. Returns what went: paths, files, bytes, MiB, and ``fits`` (at most
    ``CARRY_LIMIT``)."""
    out, dest = Path(out), Path(dest)
    if dest.resolve() == out.resolve() or out.resolve() in dest.resolve().parents:
        raise ValueError(f"{dest}: the carry set goes outside the run directory {out}")
    paths = carry_state(out, cfg)
    if not paths:
        raise CheckpointError(f"{out}: no checkpoint or stage result to carry (has the run started?)")
    for rel in paths:
        src, dst = out / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dst)
    sizes = {str(rel): size_of(dest / rel) for rel in paths}
    total = sum(sizes.values())
    files = sum(1 if (dest / rel).is_file() else sum(1 for f in (dest / rel).rglob("*") if f.is_file())
                for rel in paths)
    return {"out": str(out), "dest": str(dest), "paths": sizes, "files": files, "bytes": total,
            "mib": round(total / 2**20, 3), "limit_mib": CARRY_LIMIT >> 20, "fits": total <= CARRY_LIMIT}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opencomposer.pipeline.carry",
                                 description="copy a run directory's carry set (what --resume needs) to DEST")
    ap.add_argument("out", type=Path, help="the run directory (run.out_dir)")
    ap.add_argument("dest", type=Path, nargs="?", help="where to copy it; without it, list and measure only")
    ap.add_argument("--config", type=Path, help="the run's config (whether sft_model/ is needed)")
    a = ap.parse_args(argv)
    cfg = None
    if a.config is not None:
        from opencomposer.config import load_config
        from opencomposer.rl.config import RLRunConfig
        cfg = load_config(a.config, RLRunConfig)
    if a.dest is None:
        sizes = {str(p): size_of(a.out / p) for p in carry_state(a.out, cfg)}
        total = sum(sizes.values())
        res = {"out": str(a.out), "paths": sizes, "bytes": total, "mib": round(total / 2**20, 3),
               "limit_mib": CARRY_LIMIT >> 20, "fits": total <= CARRY_LIMIT}
    else:
        res = copy_carry(a.out, a.dest, cfg)
    print(json.dumps(res))
    return 0 if res["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
