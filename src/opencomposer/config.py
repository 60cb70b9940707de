"""Configs: pydantic models loaded from TOML, strict about keys and values.

Every entry point has one root model, and its shipped configs sit in a folder named for the
command, ``configs/<command>/NAME.toml`` (``cli/configs.py`` maps the folders to the models).
``load_config(path, Model)`` reads a TOML file and turns any problem into a ``ConfigError``
that names the file, the key and what was expected, e.g.::

    configs/train/demo.toml: key 'agent.max_turns': expected an integer >= 1, got 0

The sections more than one root uses are defined here, once: ``ModelSection`` (``[model]``),
``SamplingSection`` (the sampling keys of ``[rollout]`` and ``[gate]``), ``LossSection``
(``[loss]``, the settings of ``train.loss.LossConfig``), ``AgentConfig`` and ``SandboxConfig``.

Test: ``pytest tests/unit/test_config.py tests/unit/test_config_keys.py`` (every shipped key read or refused).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config file that cannot be used; the message says where and why."""


class Strict(BaseModel):
    """Base of every config model: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# The tools that change a file (harness/tools.EDIT_TOOLS); AgentConfig.edit_tools picks the ones offered.
EditTool = Literal["edit_file", "replace_lines", "write_file"]


class AgentConfig(Strict):
    max_turns: int = Field(50, ge=1, description="model turns before the episode is cut")
    max_tokens: int = Field(64_000, ge=1, description="total prompt+completion tokens")
    max_seconds: float = Field(600.0, gt=0, description="wall clock for one episode")
    max_idle_turns: int = Field(0, ge=0, description="consecutive turns without a tool call that end the episode "
                                "as 'idle' (0 = never; a model that cannot call tools then costs a few turns, "
                                "not max_turns)")
    command_timeout: float = Field(60.0, gt=0, description="seconds for one `run` call")
    grade_timeout: float | None = Field(
        None, gt=0, description="seconds the hidden tests may run when the episode is graded, when below the task's "
        "[tests] timeout (unset: the task's). An edit that makes the tests hang costs its batch this long; a test "
        "run cut short earns no reward")
    grade_fail_fast: bool = Field(
        True, description="the hidden tests stop at the first FAIL_TO_PASS or PASS_TO_PASS test that does not pass "
        "(pytest's own order): the reward is 0 whatever the rest do, so it is the same reward, sooner (a library with "
        "a slow suite: emoji's 11.4 s -> 0.55 s on the unchanged workspace); the episode's record then holds only "
        "the tests that ran")
    max_output_chars: int = Field(16_000, ge=256, description="cap on one observation")
    search_max_results: int = Field(50, ge=1)
    summarize_at: int = Field(0, ge=0, description="context tokens that trigger a self-summary (0 = never)")
    summary_keep_turns: int = Field(0, ge=0, description="latest turns carried into the next segment as text")
    max_summaries: int = Field(8, ge=0, description="summaries per episode; past it the context limit applies")
    edit_tools: list[EditTool] = Field(
        ["edit_file", "write_file"], min_length=1,
        description="the edit tools the agent is offered: edit_file (old text -> new), replace_lines "
                    "(line numbers -> new), write_file (a whole file)")
    lint_tool: bool = Field(False, description="offer the lint tool: ruff's findings in a Python file (undefined "
                            "names, unused variables, syntax), run on the host on the file's text")
    edit_check: Literal["off", "warn", "refuse"] = Field(
        "off", description="an edit that would leave a Python file unparseable (one that parsed before): off; warn "
        "(made, and its answer says where the file stops parsing); refuse (the file is left unchanged and the "
        "answer says why, so the agent can try again)")

    @model_validator(mode="after")
    def _edit_tools_distinct(self) -> "AgentConfig":
        if len(set(self.edit_tools)) < len(self.edit_tools):
            raise ValueError(f"edit_tools {self.edit_tools} names a tool twice")
        return self

    @model_validator(mode="after")
    def _summary_fits(self) -> "AgentConfig":
        if self.summarize_at and self.summarize_at >= self.max_tokens:
            raise ValueError(f"summarize_at={self.summarize_at} must be below max_tokens={self.max_tokens}: "
                             f"the summary request and the summary need room in the context")
        return self


# A sandbox backend as a config names it: "auto" (the default everywhere model-driven commands
# run) is the strongest isolating backend of this machine, "local" isolates nothing
# (sandbox.resolve_backend; docs/isolation.md).
Backend = Literal["auto", "namespace", "gvisor", "docker", "local"]


class SandboxConfig(Strict):
    backend: Backend = Field("auto", description="auto: namespace, else gvisor; local only when named (not isolated)")


class ModelSection(Strict):
    """``[model]``: the policy a run starts from."""

    name: str = Field("smollm2-135m", description="smollm2-135m | tiny-random | a local HF dir | a hub id")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"


# The sampling keys as types, so a section that needs other defaults (the gate samples greedily)
# states only the default and keeps the bounds and the meaning.
Temperature = Annotated[float, Field(ge=0, description="sampling temperature (0: greedy)")]
MaxNewTokens = Annotated[int, Field(ge=1, description="per model turn")]
MaxBatch = Annotated[int, Field(ge=1, description="sequences generated together")]
Engine = Literal["hf", "builtin", "server"]


class SamplingSection(Strict):
    """How episodes sample from the policy: the keys ``[rollout]`` (rl) and ``[gate]`` (realtime) share."""

    temperature: Temperature = 0.8
    max_new_tokens: MaxNewTokens = 256
    max_batch: MaxBatch = 16
    backend: Backend = Field("auto", description="sandbox of the episodes (auto: namespace, else gvisor; "
                                                 "local only when named, not isolated)")
    engine: Engine = Field(
        "hf", description="'builtin': inference/ engine (paged KV, prefix cache: agent turns are not "
                          "re-prefilled); 'hf': transformers generate on the model; 'server': an "
                          "`opencomposer serve --weights-from` process (rl only: rollout.base_url, fed through [sync])")


class LossSection(Strict):
    """``[loss]``: the clipped policy-gradient loss, ``train.loss.LossConfig`` less its per-batch ``normalizer``."""

    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.28, ge=0)
    kl_coef: float = Field(0.0, ge=0, description="k1/k3 KL to the reference policy when > 0")
    kl_estimator: Literal["k1", "k3"] = "k1"
    is_correction: Literal["none", "truncate", "mask"] = Field(
        "none", description="train-inference mismatch: none (the ratio to the sampler's log-probs, clipped) | "
        "truncate | mask (the ratio to the trainer's, each token weighted by p_trainer/p_sampler capped at is_cap, "
        "or dropped outside [1/is_cap, is_cap]); the mismatch is logged either way (train/loss.py)")
    is_cap: float = Field(2.0, gt=1, description="the importance weight's bound for is_correction")
    is_level: Literal["token", "sequence"] = Field(
        "token", description="what is_correction weights: token (each token by its own p_trainer/p_sampler) | "
        "sequence (each sample's loss tokens by one weight, the geometric mean of its tokens' ratios, capped at "
        "is_cap or the whole sample dropped outside [1/is_cap, is_cap]; is_corrected_fraction then counts "
        "sequences, not tokens)")

    def loss_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``train.loss.LossConfig`` (a subclass's own keys left out)."""
        return {"clip_low": self.clip_low, "clip_high": self.clip_high, "kl_coef": self.kl_coef,
                "kl_estimator": self.kl_estimator, "is_correction": self.is_correction, "is_cap": self.is_cap,
                "is_level": self.is_level}


class RunSection(Strict):
    """``[run]``: where a root writes and its seed; each root adds its own keys (steps, schedule...)."""

    out_dir: str
    seed: int = 0


class AgentRunConfig(Strict):
    """Root config of ``opencomposer agent`` (and of ``opencomposer eval --config``)."""

    agent: AgentConfig = AgentConfig()
    sandbox: SandboxConfig = SandboxConfig()


M = TypeVar("M", bound=BaseModel)


def _describe(err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"key '{loc}': unknown key (check the spelling; allowed keys are the model's fields)"
    if kind == "missing":
        return f"key '{loc}': required but missing"
    got = err.get("input")
    msg = err["msg"].removeprefix("Value error, ")
    if isinstance(got, dict):  # a check across keys of a table: the message names them
        return f"table '{loc}': {msg}"
    return f"key '{loc}': {msg.lower()}, got {got!r}"


def validate(data: dict[str, Any], model: type[M], source: str) -> M:
    """Validate a dict against ``model``; errors name ``source`` and every bad key."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        lines = [f"{source}: {_describe(err)}" for err in e.errors()]
        raise ConfigError("\n".join(lines)) from None


def load_config(path: str | Path, model: type[M]) -> M:
    """Read TOML at ``path`` into ``model``. Missing file, bad TOML and bad keys all raise ConfigError."""
    path = Path(path)
    if not path.is_file():
        moved = " (shipped configs now sit in a folder per command: configs/<command>/NAME.toml, " \
                "e.g. configs/train/demo.toml)" if path.parent.name == "configs" else ""
        raise ConfigError(f"{path}: config file not found{moved}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text: {e}") from None
    return validate(data, model, str(path))
