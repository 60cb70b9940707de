"""The root config of ``opencomposer realtime``, loaded from TOML (``configs/realtime/realtime.toml``).

    cfg = load_config("configs/realtime/realtime.toml", RealtimeConfig)

Tables: ``[server]`` (the running ``opencomposer serve`` to hot-swap into), ``[logs]``
(its ``--log-dir``), ``[model]`` (the policy the server started from), ``[reward]``
(the per-completion reward, ``realtime/rewards.py``), ``[train]`` (``TrainConfig``),
``[learn]`` (batching of one cycle's single epoch), ``[loss]`` (``config.LossSection``, as in
``opencomposer train``), ``[gate]`` (the eval suite, the regression rule, and the sampling keys of
``config.SamplingSection``), ``[agent]`` (limits of the gate's episodes), ``[run]``.
Unknown keys and bad values are errors naming the file and key.

Test: ``pytest tests/unit/realtime/test_config.py``.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from opencomposer.config import (
    AgentConfig,
    ConfigError,
    LossSection,
    MaxBatch,
    ModelSection,
    RunSection,
    SamplingSection,
    Strict,
    Temperature,
)
from opencomposer.train.config import TrainConfig

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | float, what: str = "duration") -> float:
    """``"5h"``, ``"30m"``, ``"90s"``, ``"1.5d"`` or a number of seconds -> seconds (> 0)."""
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        m = _DURATION.match(text)
        if not m:
            raise ConfigError(f"{what}: {text!r} is not a duration; expected e.g. 5h, 30m, 90s or 1.5d")
        seconds = float(m.group(1)) * _UNIT[m.group(2)]
    if not seconds > 0:
        raise ConfigError(f"{what}: {text!r} must be longer than 0 s")
    return seconds


class ServerSection(Strict):
    url: str = Field("http://127.0.0.1:8000", description="the serve process (with or without /v1)")
    arm: str = Field("a", description="the arm whose weights the loop trains and replaces")
    admin_token: str | None = Field(None, description="as given to serve --admin-token")
    deploy: bool = Field(True, description="false: train and gate only, never swap (dry run)")
    timeout_s: float = Field(300.0, gt=0)


class LogsSection(Strict):
    dir: str = Field(..., description="serve --log-dir")
    since: float = Field(0.0, ge=0, description="unix time of the first record the first cycle takes")


class ServedModelSection(ModelSection):
    """``[model]``, whose ``name`` must be given: the loop cannot guess what the server runs."""

    name: str = Field(..., description="what the server started from: smollm2-135m | tiny-random | HF dir")


class RewardSection(Strict):
    """r = kept*K - reverted*R - dissatisfied*D - latency*min(1, latency_s / latency_budget_s)."""

    kept: float = Field(1.0, ge=0, description="the session's edit was kept")
    reverted: float = Field(1.0, ge=0, description="the session's edit was reverted")
    dissatisfied: float = Field(0.5, ge=0, description="a follow-up the classifier calls dissatisfied")
    latency: float = Field(0.2, ge=0, description="weight of the latency term")
    latency_budget_s: float = Field(10.0, gt=0, description="latency at which the term is full")
    threshold: float = Field(0.5, gt=0, lt=1, description="classifier probability above which a follow-up is dissatisfied")
    std_normalize: bool = Field(False, description="divide advantages by the window's reward std")


class LearnSection(Strict):
    batch_completions: int = Field(16, ge=1, description="completions per optimizer step (single epoch over the window)")
    max_completions: int = Field(4096, ge=1, description="most completions one cycle trains on (newest kept)")
    max_tokens: int = Field(512, ge=1, description="loss normaliser per completion (constant, no length normalisation)")
    min_completions: int = Field(1, ge=1, description="fewer usable completions than this: nothing to train on")
    only_own_arm: bool = Field(True, description="train only on completions of server.arm (on-policy tokens)")


class GateSection(SamplingSection):
    """``[gate]``: the suite a candidate must not regress on, sampled greedily by its own engine."""

    suite: str = Field(..., description="eval suite name (configs/suites/NAME.toml), suite TOML or task dir")
    k: int = Field(1, ge=1)
    metric: str = "pass@1"
    tolerance: float = Field(0.0, ge=0, description="candidate may be this much worse (eval.gate.compare)")
    strict: bool = Field(False, description="true: the candidate must show it is within the tolerance")
    n_boot: int = Field(2000, ge=100)
    # the shared sampling keys, with the gate's defaults; no 'server' engine: the gate loads each checkpoint
    temperature: Temperature = 0.0
    max_batch: MaxBatch = 8
    engine: Literal["hf", "builtin"] = Field("builtin", description="'builtin': inference/ engine; 'hf': "
                                                                    "transformers generate")


class CycleRunSection(RunSection):
    """``[run]`` of ``opencomposer realtime``: ``RunSection``'s keys, and the cycle's schedule."""

    out_dir: str = "runs/realtime"
    every: str = Field("5h", description="time between cycles for --every's default")
    keep_candidates: int = Field(3, ge=1)


class RealtimeConfig(Strict):
    server: ServerSection = ServerSection()
    logs: LogsSection
    model: ServedModelSection
    reward: RewardSection = RewardSection()
    train: TrainConfig = TrainConfig(lr=1e-5)
    learn: LearnSection = LearnSection()
    loss: LossSection = LossSection()
    gate: GateSection
    agent: AgentConfig = AgentConfig()
    run: CycleRunSection = CycleRunSection()

    @model_validator(mode="after")
    def _no_reference(self) -> RealtimeConfig:
        if self.loss.kl_coef:
            raise ValueError(f"loss.kl_coef = {self.loss.kl_coef}: the realtime loop trains without a KL term "
                             "(it keeps no reference model); leave it 0")
        return self
