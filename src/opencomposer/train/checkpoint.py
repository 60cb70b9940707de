"""Checkpoints of a ``Trainer`` (resume exactly) and exports of its model (deploy anywhere).

    save_checkpoint("runs/a/ckpt", trainer, {"used_tasks": [...], "metrics": [...]}, step=12)
    state = load_checkpoint("runs/a/ckpt", trainer)     # the newest, via the `latest` file
    export_model("runs/a/model", trainer)               # then load_model("runs/a/model")

Layout of ``<dir>/step-0012/``:

* ``model/``: full fine-tuning: an HF model directory (``save_pretrained``: safetensors,
  config, tokenizer), itself loadable with ``load_model``. LoRA: the peft adapter
  (``adapter_model.safetensors`` + ``adapter_config.json``, whose base model is named).
* ``optimizer.pt`` (AdamW state), ``rng.pt`` (torch, CUDA and ``random`` RNG states,
  restored on load so a resumed run draws what an uninterrupted one would).
* ``trainer.json`` (weights version, LoRA or not, the TrainConfig) and ``state.json``
  (the caller's JSON state, plus ``step``).

Each checkpoint is written into a temp dir and renamed into place, then ``latest`` is
replaced atomically, so a crash leaves the previous checkpoint as the newest; only the
last ``keep`` are kept. The temp dir a killed save leaves (``.step-NNNN.tmp-<host>-<pid>-*``,
``paths.temp_name``) is removed by the next save or load once its owner is dead. Every load
problem raises ``CheckpointError`` naming the file.

A sharded trainer (``train/distributed.py``) writes the same format: every rank takes part
in gathering the full weights and AdamW state to rank 0 (CPU), rank 0 writes, and its
outcome reaches every rank (``distributed.on_main``) so no rank waits on a failed write.
``rng-ranks.pt`` adds every rank's RNG state. Loading reads on rank 0 and broadcasts to
the shards, so a checkpoint resumes on any number of ranks (RNG states then restart from
rank 0's where the count differs).

``TrainConfig.checkpoint_format = "sharded"`` is the layout for models whose whole state does
not fit one host (the gathered one needs ~16 bytes a parameter on rank 0): ``shards/`` replaces
``model/`` and ``optimizer.pt``, a ``torch.distributed.checkpoint`` (DCP) directory in which
every rank writes its own shards of the weights and AdamW state, keyed by parameter name
(``.metadata``, ``__<rank>_0.distcp``; trainable weights only, a tied one once; no AdamW state
before the first step). The RNG and JSON files are as above; ``trainer.json`` says
``"layout": "sharded"``. Every rank writes into rank 0's temp dir, DCP's collectives carry one
rank's write error to all, then rank 0 checks that every file ``.metadata`` names is there and
renames. ``load_checkpoint`` reads the layout from ``trainer.json``, whatever the trainer's
config, and DCP reshards: a checkpoint of N ranks resumes on M, or in one process (which
writes and reads the same layout without a process group). ``export_model`` still gathers.

Test: ``pytest tests/unit/train/test_checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from opencomposer.paths import remove_stale_temps, replace_dir, temp_dir, temp_name
from opencomposer.train import distributed
from opencomposer.train.trainer import Trainer

CHECKPOINT_FORMAT = "opencomposer.checkpoint/1"
LATEST = "latest"
SHARDS = "shards"  # a sharded checkpoint's DCP directory
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file."""


def step_dir_name(step: int) -> str:
    return f"step-{step:04d}"


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
    if d.main:  # what a killed save left (rank 0 makes the temp dirs, so it alone judges them)
        remove_stale_temps(root)
    if trainer.cfg.checkpoint_format == "sharded":
        _save_sharded(root, final, trainer, state_text, step, keep)
    elif d.enabled:  # collectives first, on every rank; then rank 0 writes what they gathered
        weights, optimizer = trainer.full_state_dict(), _full_optimizer_state(trainer)
        rngs = distributed.gather(_rng_state(), d)
        distributed.on_main(d, lambda: _write_step(root, final, trainer, state_text, step, keep, rngs,
                                                   lambda tmp: _write_full(tmp, trainer, weights, optimizer)),
                            f"{final}: rank 0 could not write the checkpoint", CheckpointError)
    else:
        _write_step(root, final, trainer, state_text, step, keep, None,
                    lambda tmp: _write_full(tmp, trainer, None, trainer.optimizer.state_dict()))
    return final


def _save_sharded(root: Path, final: Path, trainer: Trainer, state_text: str, step: int, keep: int | None) -> None:
    """Every rank writes its shards into rank 0's temp dir; once all have (DCP's own collectives
    carry any rank's failure to every rank), rank 0 adds the small files and renames it into place."""
    d = trainer.dist
    tmp = Path(distributed.on_main(d, lambda: str(_new_temp(final)),
                                   f"{root}: rank 0 could not make a temp dir", CheckpointError))
    try:
        _write_shards(tmp / SHARDS, trainer, final)
        rngs = distributed.gather(_rng_state(), d) if d.enabled else None
    except BaseException:
        if d.main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    distributed.on_main(d, lambda: _write_step(root, final, trainer, state_text, step, keep, rngs,
                                               lambda t: _check_shards(t / SHARDS), tmp),
                        f"{final}: rank 0 could not finish the checkpoint", CheckpointError)


def _write_full(tmp: Path, trainer: Trainer, weights: dict[str, torch.Tensor] | None, optimizer: dict) -> None:
    # weights=None: the model's own state dict (not sharded)
    trainer.model.save_pretrained(tmp / "model", **({} if weights is None else
                                                     {"state_dict": _without_twins(weights, trainer.model)}))
    trainer.tokenizer.save_pretrained(tmp / "model")
    torch.save(optimizer, tmp / "optimizer.pt")


def _write_step(root: Path, final: Path, trainer: Trainer, state_text: str, step: int, keep: int | None,
                rngs: list | None, payload: Callable[[Path], Any], tmp: Path | None = None) -> None:
    """``payload(tmp)`` (the weights and optimizer state), then the RNG states and JSON files
    into ``tmp`` (a new temp dir unless given), renamed to ``final``; then ``latest`` and pruning."""
    tmp = tmp or _new_temp(final)
    try:
        payload(tmp)
        torch.save(rngs[0] if rngs else _rng_state(), tmp / "rng.pt")
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
        _prune(root, keep, final.name)


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
    if trainer.dist.main:
        remove_stale_temps(path.parent)
    meta = _read_json(path / "trainer.json")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path / 'trainer.json'}: format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    if bool(meta.get("lora")) != trainer.cfg.lora:
        kinds = {True: "LoRA", False: "full fine-tuning"}
        raise CheckpointError(
            f"{path / 'trainer.json'}: checkpoint is {kinds[bool(meta.get('lora'))]} but the trainer "
            f"is set up for {kinds[trainer.cfg.lora]} (TrainConfig.lora)"
        )
    state = _read_json(path / "state.json")
    layout = meta.get("layout", "full")  # checkpoints from before sharded ones existed: full
    if layout == "sharded":
        _load_shards(path, trainer)
    elif layout != "full":
        raise CheckpointError(f"{path / 'trainer.json'}: layout {layout!r}, expected 'full' or 'sharded'")
    elif trainer.dist.enabled:
        _load_sharded(path, trainer)
    else:
        if trainer.cfg.lora:
            _load_adapter(path / "model" / "adapter_model.safetensors", trainer.model)
        else:
            _load_full(path / "model", trainer.model)
        optimizer = _torch_load(path / "optimizer.pt")
        try:
            trainer.optimizer.load_state_dict(optimizer)
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"{path / 'optimizer.pt'}: does not fit this trainer's parameters: {e}") from None
    _restore_rng(path, trainer.dist)
    trainer.version = int(meta["version"])
    trainer.base_lr = float(meta.get("lr", trainer.base_lr))  # older checkpoints: the config's
    trainer.schedule_start = int(meta.get("schedule_start", 0))
    return state


def export_checkpoint(dir: str | Path, out: str | Path, model: str | None = None) -> dict[str, Any]:
    """A checkpoint of either layout (``dir``: a step dir, or a run's checkpoint dir whose
    ``latest`` names one) -> a plain HF model directory ``out`` (LoRA merged in), in one
    process. Only the weights are read, so a sharded run's step needs its weights' memory on
    one host, not the AdamW state's. ``model``: the base to load them into (default: the one
    ``trainer.json`` names). Returns what was exported."""
    from opencomposer.models import load_model
    from opencomposer.train.config import TrainConfig

    path = resolve_checkpoint(dir)
    meta = _read_json(path / "trainer.json")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path / 'trainer.json'}: format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    layout, base = meta.get("layout", "full"), model or meta.get("model")
    if not base:
        raise CheckpointError(f"{path / 'trainer.json'}: names no base model; pass the model the run started from")
    hf, tok = load_model(base, dtype=torch.float32)
    cfg = TrainConfig.model_validate({**meta.get("config", {}), "lora": bool(meta.get("lora"))})
    trainer = Trainer(hf, tok, cfg, name=meta.get("model"), dist=distributed.SINGLE)
    if layout == "sharded":
        _load_shards(path, trainer, optimizer=False)
    elif cfg.lora:
        _load_adapter(path / "model" / "adapter_model.safetensors", trainer.model)
    else:
        _load_full(path / "model", trainer.model)
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
                                               {"state_dict": _without_twins(weights, trainer.model)}),
                            f"{final}: rank 0 could not export the model", CheckpointError)
        return final
    # Merge into a copy: merging in place would end the trainer's adapters.
    model = copy.deepcopy(trainer.model).merge_and_unload() if trainer.cfg.lora else trainer.model
    _export(final, trainer, model, {})
    return final


def _export(final: Path, trainer: Trainer, model: Any, save_kwargs: dict) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final.parent)
    tmp = _new_temp(final)
    try:
        model.save_pretrained(tmp, **save_kwargs)
        trainer.tokenizer.save_pretrained(tmp)
        _replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def _load_sharded(path: Path, trainer: Trainer) -> None:
    """Rank 0 reads the checkpoint; weights and AdamW state go to every rank's shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

    d = trainer.dist
    if trainer.cfg.lora:
        raise CheckpointError(f"{path}: resuming a LoRA checkpoint on {d.world} ranks is not supported; "
                              "resume it in one process")
    read: dict[str, dict] = {"weights": {}, "optimizer": {}}  # rank 0's; the shards get them through DSD

    def read_on_main() -> None:
        read["weights"] = _full_weights(path / "model", trainer.model)
        names = _trainable_names(trainer)
        try:
            read["optimizer"] = _rekey(_torch_load(path / "optimizer.pt"), lambda i: names[int(i)])
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


def _twins(model: Any) -> list[list[str]]:
    """Names that share one parameter (a tied lm_head and embed_tokens), in module order."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _without_twins(weights: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """Gathered weights name a tied tensor twice; ``save_pretrained`` of a plain model writes it
    once, under its first name, and so does this (the files are the same either way)."""
    drop = {n for names in _twins(model) for n in names[1:]}
    return {k: v for k, v in weights.items() if k not in drop}


def _full_weights(model_dir: Path, model: Any) -> dict[str, torch.Tensor]:
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


def _load_adapter(file: Path, model: Any) -> None:
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


def _load_full(model_dir: Path, model: Any) -> None:
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


# --------------------------------------------------------------------------- sharded (DCP)


def _dcp_options(trainer: Trainer) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # frozen weights (LoRA's base) are the base model's, as in the full layout. Loading is not
    # strict because templates lack them and a tied weight's second name; dcp.load still insists
    # that every key of the template is in the files.
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _shard_templates(trainer: Trainer, optimizer: bool) -> dict[str, Any]:
    """This rank's model (and AdamW) state by parameter name, as DTensor shards (whole tensors in
    one process): what ``dcp.save`` writes, and what ``dcp.load`` fills in place."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    opts = _dcp_options(trainer)
    state = {"model": _without_twins(get_model_state_dict(trainer.model, options=opts), trainer.model)}
    if optimizer:
        state["optimizer"] = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=opts)
    return state


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    with warnings.catch_warnings():  # DCP warns that one process means one process: it is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_shards(shards: Path, trainer: Trainer, final: Path) -> None:
    """This rank's weights and AdamW state (DTensor shards, or whole tensors in one process)
    into ``shards`` (to become ``final``), keyed by parameter name; a collective."""
    import torch.distributed.checkpoint as dcp

    # before the first step there is no AdamW state, and DSD would make one by a zero-lr step
    # (step count 1: not the optimizer a resumed run would have had), so it is left out
    state = _shard_templates(trainer, optimizer=bool(trainer.optimizer.state))
    try:
        with _quiet_single_process():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(shards),  # one file a rank, fsynced
                     no_dist=not trainer.dist.enabled)
    except (Exception, dcp.api.CheckpointException) as e:  # the latter a BaseException
        raise CheckpointError(f"{final}: could not write the sharded checkpoint ({_failures(e)}); "
                              f"the newest checkpoint is unchanged") from None


def _load_shards(path: Path, trainer: Trainer, optimizer: bool = True) -> None:
    """Weights and AdamW state (``optimizer``: unless False) from ``path/shards`` into this
    rank's shards, whatever world size wrote them (DCP reads the overlap of the saved chunks
    with each rank's own)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    d, shards, opts = trainer.dist, path / SHARDS, _dcp_options(trainer)
    has_optimizer = distributed.on_main(d, lambda: _check_shards(shards), f"{path}: rank 0 found it unreadable",
                                        CheckpointError)
    has_optimizer = has_optimizer and optimizer
    state = _shard_templates(trainer, has_optimizer)  # in this trainer's own sharding
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=dcp.FileSystemReader(shards), no_dist=not d.enabled)
    except (Exception, dcp.api.CheckpointException) as e:
        raise CheckpointError(f"{shards}: does not fit this trainer's parameters: {_failures(e)}") from None
    set_model_state_dict(trainer.model, state["model"], options=opts)
    if has_optimizer:
        set_optimizer_state_dict(trainer.model, trainer.optimizer, state["optimizer"], options=opts)
    elif optimizer:
        trainer.optimizer.state.clear()


def _check_shards(shards: Path) -> bool:
    """Raise ``CheckpointError`` unless every file DCP's ``.metadata`` names is there, whole;
    returns whether it holds AdamW state."""
    from torch.distributed.checkpoint import FileSystemReader

    index = shards / ".metadata"
    if not index.is_file():
        raise CheckpointError(f"{shards}: no .metadata (DCP writes it last, once every rank has written): "
                              "the checkpoint is incomplete")
    try:
        metadata = FileSystemReader(shards).read_metadata()
    except Exception as e:  # unpickling errors come in many types
        raise CheckpointError(f"{index}: unreadable: {type(e).__name__}: {e}") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(f for f in needed if not (shards / f).is_file())
    short = sorted(f for f, size in needed.items() if f not in missing and (shards / f).stat().st_size < size)
    problems = [f"{what}: {', '.join(files)}" for what, files in (("missing", missing), ("cut short", short)) if files]
    if problems:
        raise CheckpointError(f"{shards}: shard files {'; '.join(problems)} (of the {len(needed)} its .metadata names)")
    return any(k.startswith("optimizer.") for k in metadata.state_dict_metadata)


def _failures(e: BaseException) -> str:
    """DCP's ``CheckpointException`` as one line per failed rank, without its tracebacks."""
    failures = getattr(e, "failures", None)
    if not failures:
        return f"{type(e).__name__}: {e}"
    return "; ".join(f"rank {rank}: {type(x).__name__}: {x}" for rank, (x, _) in sorted(failures.items()))


# --------------------------------------------------------------------------- files


def _torch_load(file: Path) -> Any:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling errors come in many types
        raise CheckpointError(f"{file}: unreadable: {type(e).__name__}: {e}") from None


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return data


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(path: Path, d: distributed.Dist) -> None:
    """This rank's saved RNG state where the world size is the saved one, else rank 0's."""
    ranks = path / "rng-ranks.pt"
    saved = _torch_load(ranks) if d.enabled and ranks.is_file() else None
    _set_rng_state(saved[d.rank] if saved is not None and len(saved) == d.world else _torch_load(path / "rng.pt"))


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


def _prune(root: Path, keep: int, current: str) -> None:
    steps = sorted(
        (int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
    )
    for _, path in steps[: max(len(steps) - max(keep, 1), 0)]:
        if path.name != current:
            shutil.rmtree(path, ignore_errors=True)
