"""Every seam of opencomposer on one page.

A newcomer reads this file to learn what talks to what:

    TaskSource -> Task -> Sandbox <- tools <- Harness loop <-> Policy
                                                 |                ^
                                             Trajectory -> RewardFn    WeightStore <- trainer

Implementations live in the component folders (``sandbox/``, ``harness/``, ``tasks/``,
``rewards/``); nothing here imports them, so every module may import this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol, runtime_checkable


# --------------------------------------------------------------------------- messages


@dataclass
class ToolCall:
    """One tool call as the policy asked for it.

    ``arguments`` is the parsed JSON object; when the call could not be parsed,
    ``error`` says why and ``raw`` keeps the text, so the harness can answer with an
    error observation and count an invalid call instead of dropping it.
    """

    name: str
    arguments: dict[str, Any]
    id: str = ""
    raw: str = ""
    error: str | None = None


@dataclass
class Message:
    """A chat message in OpenAI shape: role is system | user | assistant | tool."""

    role: str
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None


@dataclass
class PolicyOutput:
    """What a policy returns for one turn.

    ``text`` is the raw assistant text (tool calls included, in the model's own format
    for local models); ``tool_calls`` are the parsed calls. Token-level fields are
    filled by local-model policies and used by RL; other policies leave them empty.
    """

    text: str
    tool_calls: list[ToolCall]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_version: int = 0
    finish_reason: str = "stop"
    # MoE models on the engine: the experts each token of prompt + completion went to
    # (``models.moe_replay.encode_routes``), replayed by the trainer; "" otherwise
    routes: str = ""
    # The engine and the server: the policy version of each completion token, which differ when
    # new weights arrived mid-turn (``policy_version`` is then the first, the oldest); [] otherwise
    policy_versions: list[int] = field(default_factory=list)
    # The engine: the prompt's token ids, so the harness stores a MoE turn's routes once; [] otherwise
    prompt_ids: list[int] = field(default_factory=list)


class ContextLengthError(ValueError):
    """The rendered prompt leaves no room to generate in the model's context window; the
    harness answers it by summarising (``harness/summarize.py``) or ending the episode."""


# ``system_fingerprint`` of an ``opencomposer serve`` response: this, then the policy version that answered
POLICY_FINGERPRINT = "opencomposer-policy-"


@runtime_checkable
class Policy(Protocol):
    """Anything that answers a conversation with text and tool calls.

    Implementations live in ``policies/`` (the oracle, a scripted one, a local model, the
    engine, a server, any OpenAI-compatible endpoint), each built by ``policies.make_policy``.
    """

    name: str

    def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> PolicyOutput: ...


# --------------------------------------------------------------------------- sandbox


@dataclass
class ExecResult:
    """Result of one command in a sandbox. ``output`` is stdout+stderr interleaved, capped."""

    exit_code: int
    output: str
    timed_out: bool = False
    truncated: bool = False
    seconds: float = 0.0


@runtime_checkable
class Sandbox(Protocol):
    """An isolated copy-on-write workspace made from a task's base image.

    Paths given to ``read_file``/``write_file``/``list_dir`` are relative to the
    workspace root; anything that resolves outside it raises ``PathEscape``.
    """

    backend: str
    workdir: str  # the workspace root as commands inside the sandbox see it

    def exec(
        self,
        command: str | list[str],
        timeout: float = 60.0,
        max_output: int = 32_000,
        stdin: bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult: ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, data: bytes) -> None: ...

    def snapshot(self) -> str: ...

    def restore(self, snapshot_id: str) -> None: ...

    def close(self) -> None: ...


class PathEscape(ValueError):
    """A path that resolves outside the sandbox workspace."""


@dataclass
class SandboxLimits:
    """Per-sandbox resource caps; 0 turns one off. Isolating backends enforce them
    (``sandbox/limits.py`` says how); ``local`` ignores them.

    ``memory_mb`` caps the sandbox's processes together (one process alone where only
    rlimits are available), ``processes`` the live processes, ``cpu_seconds`` the CPU
    time of each process, ``disk_mb`` what the workspace may grow by (and /tmp),
    ``open_files`` the descriptors of each process.
    """

    memory_mb: int = 2048
    processes: int = 256
    cpu_seconds: int = 600
    disk_mb: int = 2048
    open_files: int = 1024


@dataclass
class SandboxSpec:
    """How to build a sandbox: the read-only base image and the environment it runs in.

    ``env_dir`` is the per-source Python environment (shared read-only by every task
    of that source); ``pythonpath`` entries are relative to the workspace.
    """

    base_dir: Path
    env_dir: Path | None = None
    pythonpath: list[str] = field(default_factory=list)
    network: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    limits: SandboxLimits = field(default_factory=SandboxLimits)


# --------------------------------------------------------------------------- tasks and rewards


@runtime_checkable
class TaskSource(Protocol):
    """Yields task directories (see ``tasks/format.py``) from some origin."""

    def tasks(self, out_dir: Path) -> Iterator[Path]: ...


@dataclass
class RewardResult:
    reward: float
    passed: bool
    details: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class RewardFn(Protocol):
    def __call__(self, task: Any, sandbox: Sandbox) -> RewardResult: ...


# --------------------------------------------------------------------------- weights


@runtime_checkable
class WeightStore(Protocol):
    """Where the trainer leaves weight versions for the inference workers (``sync/``):
    a flat key -> bytes map whose writes are atomic. Implementations: a directory, S3."""

    uri: str

    def put(self, key: str, data: Any) -> None: ...  # bytes, or an iterable of chunks written in order

    def get(self, key: str) -> bytes: ...  # KeyError naming the key when absent

    def list(self, prefix: str = "") -> list[str]: ...

    def delete(self, keys: list[str]) -> None: ...
