"""Checkpoints of a ``Trainer``: save, load and resume its training state exactly.

    save_checkpoint("runs/a/ckpt", trainer, {"used_tasks": [...], "metrics": [...]}, step=12)
    state = load_checkpoint("runs/a/ckpt", trainer)     # the newest, via the `latest` file

What a step directory holds and how it is written atomically and read back:
``checkpoint_files.py`` (every load problem raises ``CheckpointError`` naming the file). Exports of
the model (deploy anywhere) are ``export.py``'s.

A sharded trainer (``train/distributed.py``) writes the same format: every rank takes part
in gathering the full weights and AdamW state to rank 0 (CPU), rank 0 writes, and its
outcome reaches every rank (``distributed.on_main``) so no rank waits on a failed write.
``rng-ranks.pt`` adds every rank's RNG state. Loading reads on rank 0 and broadcasts to
the shards, so a checkpoint resumes on any number of ranks (RNG states then restart from
rank 0's where the count differs).

``TrainConfig.checkpoint_format = "sharded"`` writes each rank's own shards instead, for models
whose whole state does not fit one host (``sharded_checkpoint.py``); ``load_checkpoint`` reads
the layout from ``trainer.json``, whatever the trainer's config.

Test: ``pytest tests/unit/train/test_checkpoint.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from opencomposer.paths import remove_stale_temps
from opencomposer.train import distributed
from opencomposer.train.checkpoint_files import (
    LATEST,
    CheckpointError,
    full_weights,
    load_adapter,
    load_full,
    read_json,
    read_meta,
    restore_rng,
    rng_state,
    step_dir_name,
    torch_load,
    without_twins,
    write_step,
)
from opencomposer.train.sharded_checkpoint import load_shards, save_sharded
from opencomposer.train.trainer import Trainer


def save_checkpoint(dir: str | Path, trainer: Trainer, state: dict[str, Any], step: int, keep: int | None = 3) -> Path:
    """Write ``<dir>/step-NNNN`` atomically, point ``latest`` at it, keep the newest ``keep``.
    Sharded trainer: every rank must call it. The layout is ``trainer.cfg.checkpoint_format``."""
    root = Path(dir)
    root.mkdir(parents=True, exist_ok=True)
    try:
        state_text = json.dumps({**state, "step": step}, indent=1)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{root}: the state to save is not JSON-serialisable: {e}") from None
    final = root / step_dir_name(step)
    d = trainer.dist
    # what a killed save left (rank 0 makes the temp dirs, so it alone judges them)
    distributed.main_does(d, lambda: remove_stale_temps(root))
    if trainer.cfg.checkpoint_format == "sharded":
        save_sharded(root, final, trainer, state_text, step, keep)
    elif d.enabled:  # collectives first, on every rank; then rank 0 writes what they gathered
        weights, optimizer = trainer.full_state_dict(), _full_optimizer_state(trainer)
        rngs = distributed.gather(rng_state(), d)
        distributed.on_main(d, lambda: write_step(root, final, trainer, state_text, step, keep, rngs,
                                                  lambda tmp: _write_full(tmp, trainer, weights, optimizer)),
                            f"{final}: rank 0 could not write the checkpoint", CheckpointError)
    else:
        write_step(root, final, trainer, state_text, step, keep, None,
                   lambda tmp: _write_full(tmp, trainer, None, trainer.optimizer.state_dict()))
    return final


def _write_full(tmp: Path, trainer: Trainer, weights: dict[str, torch.Tensor] | None, optimizer: dict) -> None:
    # weights=None: the model's own state dict (not sharded)
    trainer.model.save_pretrained(tmp / "model", **({} if weights is None else
                                                     {"state_dict": without_twins(weights, trainer.model)}))
    trainer.tokenizer.save_pretrained(tmp / "model")
    torch.save(optimizer, tmp / "optimizer.pt")


def resolve_checkpoint(dir: str | Path) -> Path:
    """``dir`` itself if it is a step directory, else the one its ``latest`` file names."""
    root = Path(dir)
    if (root / "trainer.json").is_file():
        return root
    latest = root / LATEST
    if not latest.is_file():
        raise CheckpointError(f"{latest}: missing, so {root} holds no checkpoint to resume from")
    path = root / latest.read_text().strip()
    if not path.is_dir():
        raise CheckpointError(f"{latest}: points to {path.name!r}, which does not exist in {root}")
    return path


def load_checkpoint(dir: str | Path, trainer: Trainer) -> dict[str, Any]:
    """Restore weights, optimizer, RNG states and version into ``trainer``; returns the saved state."""
    path = resolve_checkpoint(dir)
    distributed.main_does(trainer.dist, lambda: remove_stale_temps(path.parent))
    meta = read_meta(path)
    if bool(meta.get("lora")) != trainer.cfg.lora:
        kinds = {True: "LoRA", False: "full fine-tuning"}
        raise CheckpointError(
            f"{path / 'trainer.json'}: checkpoint is {kinds[bool(meta.get('lora'))]} but the trainer "
            f"is set up for {kinds[trainer.cfg.lora]} (TrainConfig.lora)"
        )
    state = read_json(path / "state.json")
    layout = meta.get("layout", "full")  # checkpoints from before sharded ones existed: full
    if layout == "sharded":
        load_shards(path, trainer)
    elif layout != "full":
        raise CheckpointError(f"{path / 'trainer.json'}: layout {layout!r}, expected 'full' or 'sharded'")
    elif trainer.dist.enabled:
        _load_full_on_ranks(path, trainer)
    else:
        if trainer.cfg.lora:
            load_adapter(path / "model" / "adapter_model.safetensors", trainer.model)
        else:
            load_full(path / "model", trainer.model)
        optimizer = torch_load(path / "optimizer.pt")
        try:
            trainer.optimizer.load_state_dict(optimizer)
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"{path / 'optimizer.pt'}: does not fit this trainer's parameters: {e}") from None
    restore_rng(path, trainer.dist)
    trainer.version = int(meta["version"])
    trainer.base_lr = float(meta.get("lr", trainer.base_lr))  # older checkpoints: the config's
    trainer.schedule_start = int(meta.get("schedule_start", 0))
    return state


# --------------------------------------------------------------------------- weights


def _trainable_names(trainer: Trainer) -> list[str]:
    """Parameter names in the optimizer's order (its state is keyed by these positions)."""
    return [n for n, p in trainer.model.named_parameters() if p.requires_grad]


def _full_optimizer_state(trainer: Trainer) -> dict:
    """A sharded trainer's AdamW state, whole, on rank 0 (a collective), in the layout of
    ``optimizer.state_dict()``: states and groups by parameter position, not name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if not trainer.optimizer.state:  # before the first step: DSD would make state by a zero-lr step
        return trainer.optimizer.state_dict() if trainer.dist.main else {}  # (no tensors: nothing to gather)
    by_name = get_optimizer_state_dict(trainer.model, trainer.optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not trainer.dist.main:
        return {}
    return _rekey(by_name, {n: i for i, n in enumerate(_trainable_names(trainer))}.__getitem__)


def _rekey(optimizer: dict, key: Any) -> dict:
    """An optimizer state dict with every parameter key ``k`` replaced by ``key(k)``: by name
    (what DSD speaks) <-> by position (what ``optimizer.state_dict()`` holds and we save)."""
    return {"state": {key(k): v for k, v in optimizer["state"].items()},
            "param_groups": [{**g, "params": [key(k) for k in g["params"]]} for g in optimizer["param_groups"]]}


def _load_full_on_ranks(path: Path, trainer: Trainer) -> None:
    """Rank 0 reads the checkpoint; weights and AdamW state go to every rank's shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

    d = trainer.dist
    if trainer.cfg.lora:
        raise CheckpointError(f"{path}: resuming a LoRA checkpoint on {d.world} ranks is not supported; "
                              "resume it in one process")
    read: dict[str, dict] = {"weights": {}, "optimizer": {}}  # rank 0's; the shards get them through DSD

    def read_on_main() -> None:
        read["weights"] = full_weights(path / "model", trainer.model)
        names = _trainable_names(trainer)
        try:
            read["optimizer"] = _rekey(torch_load(path / "optimizer.pt"), lambda i: names[int(i)])
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path / 'optimizer.pt'}: does not fit this trainer's parameters: "
                                  f"{type(e).__name__}: {e}") from None

    distributed.on_main(d, read_on_main, f"{path}: rank 0 could not read the checkpoint", CheckpointError)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(trainer.model, read["weights"], options=opts)
    if distributed.broadcast(bool(read["optimizer"].get("state")), d):
        set_optimizer_state_dict(trainer.model, trainer.optimizer, read["optimizer"], options=opts)
    else:  # saved before the first step: no moments to load (DSD would make some), the groups' settings
        groups = distributed.broadcast(read["optimizer"].get("param_groups", []), d)
        for group, saved in zip(trainer.optimizer.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        trainer.optimizer.state.clear()
