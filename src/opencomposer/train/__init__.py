"""Training: the ``Trainer`` (RL and SFT steps), checkpoints and exports, the CPT and SFT stages.

    from opencomposer.train import Trainer, TrainConfig, save_checkpoint, run_pretrain, run_sft

Names resolve lazily, so importing the package does not load torch or peft.

Test: ``pytest tests/unit/train``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TrainConfig": "config",
    "Trainer": "trainer",
    "frozen_copy": "trainer",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "load_weights": "checkpoint",
    "export_model": "export",
    "export_checkpoint": "export",
    "CheckpointError": "checkpoint_files",
    "run_sft": "sft",
    "run_pretrain": "pretrain",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'opencomposer.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"opencomposer.train.{_EXPORTS[name]}"), name)
