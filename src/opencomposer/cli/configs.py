"""Which root model reads a shipped config: the folder it sits in, named for the command.

    configs/agent/*.toml      opencomposer agent --config (and eval --config)   config.AgentRunConfig
    configs/train/*.toml      opencomposer train --config                       rl.config.RLRunConfig
    configs/pretrain/*.toml   opencomposer pretrain --config                    train.config.PretrainRunConfig
    configs/tasks/*.toml      opencomposer tasks make --config                  tasks.factory.FactoryConfig
    configs/realtime/*.toml   opencomposer realtime --config                    realtime.config.RealtimeConfig
    configs/suites/*.toml     opencomposer eval --suite NAME                    eval.suite.SuiteFile

(``configs/ablation/`` belongs to ``benchmarks/ablation_behaviour.py``, outside the package.)

    model = root_model("configs/train/demo.toml")   # RLRunConfig
    cfg = load_config("configs/train/demo.toml", model)

The map lives here, at the top, so ``config.py`` (the bottom layer) imports nothing above it;
import paths, so asking costs only the one component's import.

Test: ``pytest tests/unit/test_config.py tests/unit/test_config_keys.py``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from pydantic import BaseModel

from opencomposer.config import ConfigError

ROOTS: dict[str, str] = {
    "agent": "opencomposer.config:AgentRunConfig",
    "train": "opencomposer.rl.config:RLRunConfig",
    "pretrain": "opencomposer.train.config:PretrainRunConfig",
    "tasks": "opencomposer.tasks.factory:FactoryConfig",
    "realtime": "opencomposer.realtime.config:RealtimeConfig",
    "suites": "opencomposer.eval.suite:SuiteFile",
}


def root_model(config_path: str | Path) -> type[BaseModel]:
    """The root model of a shipped config file, from the folder it sits in."""
    folder = Path(config_path).parent.name
    if folder not in ROOTS:
        raise ConfigError(f"{config_path}: no root config for folder '{folder}' "
                          f"(shipped configs sit in configs/<command>/; known: {sorted(ROOTS)})")
    module, _, name = ROOTS[folder].partition(":")
    return getattr(importlib.import_module(module), name)
