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

Resume identity: ``save_checkpoint(..., identity={...})`` records what the run was in
``state.json`` (``"identity"``: flat ``setting -> value``, e.g. the model's name and
``weights_fingerprint``, the training pool's ``names_fingerprint``, the seed, the loss and LoRA
settings; ``rl/learner.py`` builds it). ``check_identity(dir, expected)`` refuses a resume whose
config differs with a ``ConfigError`` naming the setting, the checkpoint's value and the config's;
a checkpoint from before identities were recorded is resumed with a warning it returns (nothing
to compare it with).

Test: ``pytest tests/unit/train/test_checkpoint.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from opencomposer.config import ConfigError
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

IDENTITY = "identity"  # the key of state.json that holds the run's identity (check_identity)

def save_checkpoint(dir: str | Path, trainer: Trainer, state: dict[str, Any], step: int, keep: int | None = 3,
                    identity: dict[str, Any] | None = None, keep_every: int = 0) -> Path:
    """Write ``<dir>/step-NNNN`` atomically, point ``latest`` at it, keep the newest ``keep`` (and
    the weights of every ``keep_every``-th step: milestones, without optimizer state).
    Sharded trainer: every rank must call it. The layout is ``trainer.cfg.checkpoint_format``.
    ``identity``: what the run was (``check_identity`` compares a resume's with it)."""
    root = Path(dir)
    root.mkdir(parents=True, exist_ok=True)
    extra = {IDENTITY: identity} if identity is not None else {}
    try:
        state_text = json.dumps({**state, **extra, "step": step}, indent=1)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{root}: the state to save is not JSON-serialisable: {e}") from None
    final = root / step_dir_name(step)
    d = trainer.dist
    # what a killed save left (rank 0 makes the temp dirs, so it alone judges them)
    distributed.main_does(d, lambda: remove_stale_temps(root))
    if trainer.cfg.checkpoint_format == "sharded":
        save_sharded(root, final, trainer, state_text, step, keep, keep_every)
    elif d.enabled:  # collectives first, on every rank; then rank 0 writes what they gathered
        weights, optimizer = trainer.full_state_dict(), _full_optimizer_state(trainer)
        rngs = distributed.gather(rng_state(), d)
        distributed.on_main(d, lambda: write_step(root, final, trainer, state_text, step, keep, rngs,
                                                  lambda tmp: _write_full(tmp, trainer, weights, optimizer),
                                                  keep_every=keep_every),
                            f"{final}: rank 0 could not write the checkpoint", CheckpointError)
    else:
        write_step(root, final, trainer, state_text, step, keep, None,
                   lambda tmp: _write_full(tmp, trainer, None, trainer.optimizer.state_dict()), keep_every=keep_every)
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


def load_weights(dir: str | Path, trainer: Trainer) -> int:
    """The weights alone of the step directory ``dir`` (or the one its ``latest`` names) into ``trainer``:
    what reading a milestone needs (``save_checkpoint(..., keep_every=N)`` kept its weights, not its
    optimizer state); the optimizer, RNG and version are left as they are. -> the step it was saved at.
    One process, full layout (a sharded run reads a milestone with ``load_checkpoint`` on its ranks)."""
    path = resolve_checkpoint(dir)
    meta = read_meta(path)
    if bool(meta.get("lora")) != trainer.cfg.lora:
        raise CheckpointError(f"{path / 'trainer.json'}: checkpoint lora={bool(meta.get('lora'))}, trainer "
                              f"lora={trainer.cfg.lora} (TrainConfig.lora)")
    if meta.get("layout", "full") != "full" or trainer.dist.enabled:
        raise CheckpointError(f"{path}: load_weights reads a full-layout checkpoint in one process; this one is "
                              f"{meta.get('layout')!r} with {trainer.dist.world} rank(s): use load_checkpoint")
    if trainer.cfg.lora:
        load_adapter(path / "model" / "adapter_model.safetensors", trainer.model)
    else:
        load_full(path / "model", trainer.model)
    return int(meta["step"])


# --------------------------------------------------------------------------- resume identity

def weights_fingerprint(model: Any) -> str:
    """``sha256:<16 hex>`` of a model's state dict: every tensor's name, dtype, shape and bytes,
    in name order. Taken on the weights a run starts from (before any update), so two machines
    that load the same model agree, and a different checkpoint, dtype or build of it does not."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()[:16]


def names_fingerprint(names: Iterable[str]) -> str:
    """``sha256:<16 hex> (<n>)`` of a set of names (the training pool's task ids), order-free."""
    unique = sorted(set(names))
    return f"sha256:{hashlib.sha256(chr(10).join(unique).encode()).hexdigest()[:16]} ({len(unique)})"


def check_identity(dir: str | Path, expected: dict[str, Any]) -> str | None:
    """Refuse to resume the checkpoint at ``dir`` (a step dir, or the one ``latest`` names) for a
    run whose ``expected`` identity differs from the recorded one: a ``ConfigError`` naming the
    first differing setting, the checkpoint's value and the config's. Settings only one side
    records are not compared. Returns None when they agree, or a warning when the checkpoint
    records no identity (written before they were): it is resumed unverified."""
    path = resolve_checkpoint(dir)
    saved = read_json(path / "state.json").get(IDENTITY)
    if not isinstance(saved, dict):
        return (f"{path}: this checkpoint records no run identity (written before they were), so its model, "
                f"task pool and seed cannot be checked against the config; resuming unverified")
    for key, value in expected.items():
        if key in saved and saved[key] != value:
            raise ConfigError(f"--resume: the checkpoint {path} was written with {key} = {saved[key]!r}, "
                              f"but the config gives {key} = {value!r}; resume with the run's own settings, "
                              f"or start a new run (without --resume, or in another run.out_dir)")
    return None


# --------------------------------------------------------------------------- weights


def _trainable_names(trainer: Trainer) -> list[str]:
    """Parameter names in the optimizer's order (its state is keyed by these positions): its
    param groups' order, which is not the model's for Muon + AdamW (``train/muon.py``)."""
    name_of = {id(p): n for n, p in trainer.model.named_parameters() if p.requires_grad}
    return [name_of[id(p)] for g in trainer.optimizer.param_groups for p in g["params"]]


def _full_optimizer_state(trainer: Trainer) -> dict:
    """A sharded trainer's AdamW state, whole, on rank 0 (a collective), in the layout of
    ``optimizer.state_dict()``: states and groups by parameter position, not name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if not trainer.optimizer.state:  # before the first step: DSD would make state by a zero-lr step
        return distributed.main_does(trainer.dist, trainer.optimizer.state_dict) or {}  # (no tensors: nothing to gather)
    by_name = get_optimizer_state_dict(trainer.model, trainer.optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return distributed.main_does(trainer.dist, lambda: _rekey(
        by_name, {n: i for i, n in enumerate(_trainable_names(trainer))}.__getitem__)) or {}


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
