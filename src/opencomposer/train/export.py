"""Exports of a trained model: a plain Hugging Face model directory (LoRA merged in) that
``load_model`` and the engine load anywhere, from a live ``Trainer`` or from a checkpoint.

    export_model("runs/a/model", trainer)                   # then load_model("runs/a/model")
    export_checkpoint("runs/a/ckpt", "runs/a/model")         # ``opencomposer export``: either layout

The directory is written into a temp dir beside it and renamed into place (``paths.replace_dir``),
so a crash never leaves half a model where a loader looks. A sharded trainer gathers the full
weights to rank 0, which writes (every rank must call ``export_model``); ``export_checkpoint``
reads only a checkpoint's weights, in one process, whatever layout and world size wrote it
(``checkpoint_files.py``, ``sharded_checkpoint.py``).

Test: ``pytest tests/unit/train/test_checkpoint.py -k export``.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import torch

from opencomposer.paths import remove_stale_temps, replace_dir, temp_dir
from opencomposer.train import distributed
from opencomposer.train.checkpoint import resolve_checkpoint
from opencomposer.train.checkpoint_files import CheckpointError, load_adapter, load_full, read_meta, without_twins
from opencomposer.train.sharded_checkpoint import load_shards
from opencomposer.train.trainer import Trainer


def export_checkpoint(dir: str | Path, out: str | Path, model: str | None = None) -> dict[str, Any]:
    """A checkpoint of either layout (``dir``: a step dir, or a run's checkpoint dir whose
    ``latest`` names one) -> a plain HF model directory ``out`` (LoRA merged in), in one
    process. Only the weights are read, so a sharded run's step needs its weights' memory on
    one host, not the AdamW state's. ``model``: the base to load them into (default: the one
    ``trainer.json`` names). Returns what was exported."""
    from opencomposer.models import load_model
    from opencomposer.train.config import TrainConfig

    path = resolve_checkpoint(dir)
    meta = read_meta(path)
    layout, base = meta.get("layout", "full"), model or meta.get("model")
    if not base:
        raise CheckpointError(f"{path / 'trainer.json'}: names no base model; pass the model the run started from")
    hf, tok = load_model(base, dtype=torch.float32)
    # fp8 = "off": exporting runs no GEMM to train, and may run where the training GPU's FP8 is not
    cfg = TrainConfig.model_validate({**meta.get("config", {}), "lora": bool(meta.get("lora")), "fp8": "off"})
    trainer = Trainer(hf, tok, cfg, name=meta.get("model"), dist=distributed.SINGLE)
    if layout == "sharded":
        load_shards(path, trainer, optimizer=False)
    elif cfg.lora:
        load_adapter(path / "model" / "adapter_model.safetensors", trainer.model)
    else:
        load_full(path / "model", trainer.model)
    export_model(out, trainer)
    return {"exported": str(out), "checkpoint": str(path), "step": int(meta.get("step", -1)), "layout": layout,
            "lora": cfg.lora, "model": base, "version": int(meta.get("version", 0))}


def export_model(dir: str | Path, trainer: Trainer) -> Path:
    """A plain HF model directory (LoRA merged in) for ``load_model(dir)``; replaces ``dir``.
    Sharded: every rank must call it; rank 0 writes."""
    final = Path(dir)
    d = trainer.dist
    if d.enabled:
        weights = trainer.full_state_dict()
        distributed.on_main(d, lambda: _export(final, trainer, trainer.model,
                                               {"state_dict": without_twins(weights, trainer.model)}),
                            f"{final}: rank 0 could not export the model", CheckpointError)
        return final
    # Merge into a copy: merging in place would end the trainer's adapters.
    model = copy.deepcopy(trainer.model).merge_and_unload() if trainer.cfg.lora else trainer.model
    _export(final, trainer, model, {})
    return final


def _export(final: Path, trainer: Trainer, model: Any, save_kwargs: dict) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final.parent)
    tmp = temp_dir(final)
    try:
        model.save_pretrained(tmp, **save_kwargs)
        trainer.tokenizer.save_pretrained(tmp)
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
