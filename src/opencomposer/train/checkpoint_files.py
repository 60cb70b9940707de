"""The files of a checkpoint's step directory: how one is written atomically and read back,
every problem a ``CheckpointError`` naming the file (``checkpoint.py`` saves and loads a
trainer with these; ``sharded_checkpoint.py`` and ``export.py`` use them too).

    write_step(root, root / step_dir_name(12), trainer, state_text, 12, keep=3, rngs=None, payload=write_weights)
    meta = read_meta(path)                      # trainer.json, checked to be this format's
    load_full(path / "model", model)            # or load_adapter(...) for LoRA

Layout of ``<dir>/step-0012/``:

* ``model/``: full fine-tuning: an HF model directory (``save_pretrained``: safetensors,
  config, tokenizer), itself loadable with ``load_model``. LoRA: the peft adapter
  (``adapter_model.safetensors`` + ``adapter_config.json``, whose base model is named).
  The sharded layout has ``shards/`` instead (``sharded_checkpoint.py``).
* ``optimizer.pt`` (AdamW state), ``rng.pt`` (torch, CUDA and ``random`` RNG states,
  restored on load so a resumed run draws what an uninterrupted one would); ``rng-ranks.pt``
  every rank's, when several wrote it.
* ``trainer.json`` (format, layout, weights version, LoRA or not, the TrainConfig) and
  ``state.json`` (the caller's JSON state, plus ``step``).

Each checkpoint is written into a temp dir and renamed into place, then ``latest`` is
replaced atomically, so a crash leaves the previous checkpoint as the newest; only the
last ``keep`` are kept. The temp dir a killed save leaves (``.step-NNNN.tmp-<host>-<pid>-*``,
``paths.temp_name``) is removed by the next save or load once its owner is dead.

Test: ``pytest tests/unit/train/test_checkpoint.py``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from opencomposer.paths import replace_dir, temp_dir, temp_name
from opencomposer.train import distributed

if TYPE_CHECKING:
    from opencomposer.train.trainer import Trainer

CHECKPOINT_FORMAT = "opencomposer.checkpoint/1"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file."""


def step_dir_name(step: int) -> str:
    return f"step-{step:04d}"


def read_meta(path: Path) -> dict[str, Any]:
    """The step directory ``path``'s ``trainer.json``, checked to be this format's."""
    meta = read_json(path / "trainer.json")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path / 'trainer.json'}: format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    return meta


def write_step(root: Path, final: Path, trainer: Trainer, state_text: str, step: int, keep: int | None,
               rngs: list | None, payload: Callable[[Path], Any], tmp: Path | None = None,
               keep_every: int = 0) -> None:
    """``payload(tmp)`` (the weights and optimizer state), then the RNG states and JSON files
    into ``tmp`` (a new temp dir unless given), renamed to ``final``; then ``latest`` and pruning
    (``_prune``: the newest ``keep``, and every ``keep_every``-th step's weights)."""
    tmp = tmp or _new_temp(final)
    try:
        payload(tmp)
        torch.save(rngs[0] if rngs else rng_state(), tmp / "rng.pt")
        if rngs is not None:
            torch.save(rngs, tmp / "rng-ranks.pt")
        meta = {
            "format": CHECKPOINT_FORMAT, "layout": trainer.cfg.checkpoint_format, "step": step,
            "version": trainer.version, "model": trainer.name,
            "lr": trainer.base_lr, "schedule_start": trainer.schedule_start,
            "lora": trainer.cfg.lora, "config": trainer.cfg.model_dump(mode="json"),
            "world_size": trainer.dist.world,
        }
        (tmp / "trainer.json").write_text(json.dumps(meta, indent=1))
        (tmp / "state.json").write_text(state_text)
        _replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _write_atomic(root / LATEST, final.name + "\n")
    if keep is not None:
        _prune(root, keep, final.name, keep_every)


# --------------------------------------------------------------------------- weights


def _twins(model: Any) -> list[list[str]]:
    """Names that share one parameter (a tied lm_head and embed_tokens), in module order."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def without_twins(weights: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """Gathered weights name a tied tensor twice; ``save_pretrained`` of a plain model writes it
    once, under its first name, and so does this (the files are the same either way)."""
    drop = {n for names in _twins(model) for n in names[1:]}
    return {k: v for k, v in weights.items() if k not in drop}


def full_weights(model_dir: Path, model: Any) -> dict[str, torch.Tensor]:
    """Every tensor the model's state dict names, read from ``model_dir``; a tied weight that
    ``save_pretrained`` wrote once (lm_head = embed_tokens) is filled in from its twin."""
    weights = _read_weights(model_dir)
    for names in _twins(model):
        have = [n for n in names if n in weights]
        for n in names:
            if have and n not in weights:
                weights[n] = weights[have[0]]
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise CheckpointError(f"{model_dir}: weights do not fit the model (unexpected {unexpected[:3]}, "
                              f"missing {missing[:3]})")
    return weights


def load_adapter(file: Path, model: Any) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, _safetensors(file))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise CheckpointError(
            f"{file}: adapter does not fit the model (unexpected {result.unexpected_keys[:3]}, "
            f"missing {missing[:3]}); are lora_r and lora_target_modules the same?"
        )


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``model_dir`` (one or several shards)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(_safetensors(f))
    return weights


def load_full(model_dir: Path, model: Any) -> None:
    weights = _read_weights(model_dir)
    try:
        result = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise CheckpointError(f"{model_dir}: weights do not fit the model: {e}") from None
    # save_pretrained writes a tied weight once (e.g. lm_head = embed_tokens); others must be there.
    current = model.state_dict()
    loaded = {current[k].data_ptr() for k in weights if k in current}
    missing = [k for k in result.missing_keys if current[k].data_ptr() not in loaded]
    if result.unexpected_keys or missing:
        raise CheckpointError(
            f"{model_dir}: weights do not fit the model (unexpected {result.unexpected_keys[:3]}, missing {missing[:3]})"
        )


def _safetensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    try:
        return load_file(file)
    except Exception as e:  # safetensors raises its own error types for bad headers and sizes
        raise CheckpointError(f"{file}: unreadable safetensors: {type(e).__name__}: {e}") from None


# --------------------------------------------------------------------------- files


def torch_load(file: Path) -> Any:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling errors come in many types
        raise CheckpointError(f"{file}: unreadable: {type(e).__name__}: {e}") from None


def read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return data


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(path: Path, d: distributed.Dist) -> None:
    """This rank's saved RNG state where the world size is the saved one, else rank 0's."""
    ranks = path / "rng-ranks.pt"
    saved = torch_load(ranks) if d.enabled and ranks.is_file() else None
    _set_rng_state(saved[d.rank] if saved is not None and len(saved) == d.world else torch_load(path / "rng.pt"))


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_atomic(file: Path, text: str) -> None:
    tmp = temp_name(file)
    tmp.write_text(text)
    os.replace(tmp, file)


def _new_temp(final: Path) -> Path:
    """A new empty dir beside ``final``, to be renamed to it once complete; never a ``step-N``."""
    return temp_dir(final)


_replace_dir = replace_dir  # an existing ``final`` (a re-saved step) is swapped out first


def _prune(root: Path, keep: int, current: str, keep_every: int = 0) -> None:
    """Delete the step directories older than the newest ``keep``, except the steps that are
    multiples of ``keep_every`` (> 0): milestones that a later evaluation reads, kept without their
    optimizer state (``optimizer.pt``; a sharded step keeps its shards whole) and never resumed from
    unless ``latest`` names them."""
    steps = sorted(
        (int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
    )
    for step, path in steps[: max(len(steps) - max(keep, 1), 0)]:
        if path.name == current:
            continue
        if keep_every > 0 and step > 0 and step % keep_every == 0:
            (path / "optimizer.pt").unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
