"""What every command module shares: the root Typer app, the two consoles, the JSON last
line (``emit``), the known-error exit (``fail``), the sandbox backend and the ``--policy`` flags
as ``policies.make_policy`` options (``policy_options``).

Test: ``pytest tests/unit/cli``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import typer
from rich.console import Console

from opencomposer.config import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train coding agents in the harness they are deployed in.")
err = Console(stderr=True)
out = Console()


def emit(result: dict) -> None:
    """The machine-readable last line (under torchrun, rank 0's only: one line per run)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(json.dumps(result, default=str), flush=True)


def known_errors() -> tuple[type[BaseException], ...]:
    from opencomposer.sandbox.base import SandboxUnavailable
    from opencomposer.tasks.envs import EnvError
    from opencomposer.tasks.format import TaskFormatError
    from opencomposer.tasks.pypi import SourceError

    errs: list[type[BaseException]] = [ConfigError, TaskFormatError, SourceError, EnvError, SandboxUnavailable]
    registry = sys.modules.get("opencomposer.models.registry")  # only if a model was asked for
    if registry is not None:
        errs.append(registry.ModelLoadError)
    return tuple(errs)


def fail(e: BaseException) -> None:
    from rich.markup import escape

    # escaped: messages name config tables such as [sync] or [pretrain], which rich would eat as markup;
    # soft-wrapped: rich would otherwise break a long path inside a word ("agent.t oml"), and a path
    # in an error must stay whole to be copied
    err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, markup=True, soft_wrap=True)
    emit({"error": str(e).splitlines()[0] if str(e) else type(e).__name__})
    raise typer.Exit(2)


SANDBOX_HELP = ("sandbox backend: auto (the strongest isolating one here: namespace, else gvisor) | namespace | "
                "gvisor | docker | local (not isolated: host user, host files)")


def sandbox_backend(given: str | None, flag: str | None, config=None, key: str | None = None,
                    configured: str = "auto") -> str:
    """The backend a command runs model-driven code in: the flag's value if given, else the
    config's (``key`` of ``config``), resolved by ``sandbox.resolve_backend``. Errors name
    where the value came from, and how to choose ``local`` there."""
    from opencomposer.sandbox import SandboxUnavailable, resolve_backend

    name = given or configured
    if given:
        where = f"{flag} {name!r}"
    elif config and key:
        where = f"{config}: key '{key}' = {name!r}"
    else:
        where = f"{flag or key} (default {name!r})"
    how = " or ".join(([f"{flag} local"] if flag else []) + ([f"{key} = \"local\" in {config or 'the config'}"] if key else []))
    try:
        return resolve_backend(name, how)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    except SandboxUnavailable as e:
        raise SandboxUnavailable(f"{where}: {e}") from None


POLICY_KINDS = ("oracle", "model", "openai")  # what --policy takes


def policy_options(kind: str, task, model: Optional[str], base_url: Optional[str], api_key: Optional[str],
                   max_new_tokens: int = 256, temperature: float = 0.0) -> dict:
    """The options of ``policies.make_policy(kind, **options)`` for ``--policy KIND`` and its flags
    (a model's ``device=`` and ``batch=`` are the command's to add)."""
    if kind == "oracle":
        return {"task": task}
    if kind == "model":
        return {"model": model or "smollm2-135m", "max_new_tokens": max_new_tokens, "temperature": temperature}
    if kind == "openai":
        if not base_url:
            raise ConfigError("--policy openai needs --base-url (any OpenAI-compatible endpoint)")
        return {"model": model or "default", "base_url": base_url, "api_key": api_key}
    raise ConfigError(f"--policy {kind!r}: expected {', '.join(POLICY_KINDS[:-1])} or {POLICY_KINDS[-1]}")
