"""Which root model reads a shipped config: the folder it sits in, named for the command.

    configs/agent/*.toml      opencomposer agent --config (and eval --config)   config.AgentRunConfig
    configs/train/*.toml      opencomposer train --config                       rl.config.RLRunConfig
    configs/pretrain/*.toml   opencomposer pretrain --config                    train.config.PretrainRunConfig
    configs/tasks/*.toml      opencomposer tasks make --config                  tasks.factory.FactoryConfig
    configs/realtime/*.toml   opencomposer realtime --config                    realtime.config.RealtimeConfig
    configs/suites/*.toml     opencomposer eval --suite NAME                    eval.suite.SuiteFile

(``configs/ablation/`` belongs to ``benchmarks/ablation_behaviour.py`` and ``configs/learn/`` to
``benchmarks/learn_run.py``, outside the package.)

    model = root_model("configs/train/demo.toml")          # RLRunConfig
    cfg = load_for("configs/train/demo.toml", RLRunConfig)  # what each command's --config calls

``load_for`` refuses a shipped config of another command by name (``opencomposer train --config
configs/realtime/realtime.toml`` says whose it is) before validating. The map lives here, at the
top, so ``config.py`` (the bottom layer) imports nothing above it; its values are import paths,
so asking costs only the one component's import.

Test: ``pytest tests/unit/test_config.py tests/unit/test_config_keys.py``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from opencomposer.config import ConfigError, load_config

M = TypeVar("M", bound=BaseModel)

# folder -> the command that reads its configs
COMMANDS = {"agent": "agent / eval --config", "train": "train", "pretrain": "pretrain", "tasks": "tasks make",
            "realtime": "realtime", "suites": "eval --suite"}
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


def load_for(config_path: str | Path, model: type[M]) -> M:
    """``load_config(config_path, model)`` for a command whose root is ``model``. A config in a
    folder of ``configs/`` that belongs to another command is refused, naming the file, its
    command and this one's folder (a config elsewhere is only validated)."""
    path = Path(config_path)
    folder = path.parent.name
    if path.parent.parent.name == "configs" and folder in ROOTS:
        owner = root_model(path)
        if owner is not model:
            mine = [f for f in ROOTS if ROOTS[f].rpartition(":")[2] == model.__name__]
            raise ConfigError(f"{path}: a config of `opencomposer {COMMANDS[folder]}` ({owner.__name__}), "
                              f"not of this command ({model.__name__}: configs/{mine[0] if mine else '...'}/)")
    return load_config(path, model)
