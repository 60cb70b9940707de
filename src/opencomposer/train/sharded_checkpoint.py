"""The sharded checkpoint layout, for models whose whole state does not fit one host (the
gathered layout of ``checkpoint.py`` needs ~16 bytes a parameter on rank 0).

    save_checkpoint(dir, trainer, state, step)   # with TrainConfig(checkpoint_format="sharded")
    load_checkpoint(dir, trainer)                # reads the layout from trainer.json

``TrainConfig.checkpoint_format = "sharded"``: ``shards/`` replaces ``model/`` and ``optimizer.pt``,
a ``torch.distributed.checkpoint`` (DCP) directory in which every rank writes its own shards of
the weights and AdamW state, keyed by parameter name (``.metadata``, ``__<rank>_0.distcp``;
trainable weights only, a tied one once; no AdamW state before the first step). The RNG and
JSON files are as in the full layout; ``trainer.json`` says ``"layout": "sharded"``. Every rank
writes into rank 0's temp dir, DCP's collectives carry one rank's write error to all, then rank
0 checks that every file ``.metadata`` names is there and renames. ``load_checkpoint`` reads the
layout from ``trainer.json``, whatever the trainer's config, and DCP reshards: a checkpoint of N
ranks resumes on M, or in one process (which writes and reads the same layout without a process
group). ``export_checkpoint`` (``export.py``) reads only the weights.

Test: ``pytest tests/unit/train/test_checkpoint.py -k sharded``; on two ranks
``tests/distributed/test_distributed.py``.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from opencomposer.paths import temp_dir
from opencomposer.train import distributed
from opencomposer.train.checkpoint_files import CheckpointError, rng_state, without_twins, write_step
from opencomposer.train.trainer import Trainer

SHARDS = "shards"  # a sharded checkpoint's DCP directory


def save_sharded(root: Path, final: Path, trainer: Trainer, state_text: str, step: int, keep: int | None,
                 keep_every: int = 0) -> None:
    """Every rank writes its shards into rank 0's temp dir; once all have (DCP's own collectives
    carry any rank's failure to every rank), rank 0 adds the small files and renames it into place."""
    d = trainer.dist
    tmp = Path(distributed.on_main(d, lambda: str(temp_dir(final)),
                                   f"{root}: rank 0 could not make a temp dir", CheckpointError))
    try:
        _write_shards(tmp / SHARDS, trainer, final)
        rngs = distributed.gather(rng_state(), d) if d.enabled else None
    except BaseException:
        distributed.main_does(d, lambda: shutil.rmtree(tmp, ignore_errors=True))
        raise
    distributed.on_main(d, lambda: write_step(root, final, trainer, state_text, step, keep, rngs,
                                              lambda t: _check_shards(t / SHARDS), tmp, keep_every),
                        f"{final}: rank 0 could not finish the checkpoint", CheckpointError)


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
    state = {"model": without_twins(get_model_state_dict(trainer.model, options=opts), trainer.model)}
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


def load_shards(path: Path, trainer: Trainer, optimizer: bool = True) -> None:
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
