"""`opencomposer realtime [report|users]`: the real-time loop."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from opencomposer.cli.common import SANDBOX_HELP, emit, err, fail, known_errors, sandbox_backend
from opencomposer.cli.configs import load_for
from opencomposer.config import ConfigError

realtime_app = typer.Typer(no_args_is_help=False, help="The real-time loop: serve logs -> rewards -> train -> gate -> hot-swap.")


def _realtime_errors() -> tuple[type[BaseException], ...]:
    from opencomposer.eval.results import ResultsError
    from opencomposer.eval.suite import SuiteError
    from opencomposer.realtime.deploy import ServerRefused, ServerUnreachable

    return known_errors() + (ServerUnreachable, ServerRefused, SuiteError, ResultsError, FileNotFoundError)


@realtime_app.callback(invoke_without_command=True)
def realtime(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, help="configs/realtime/realtime.toml"),
    every: Optional[str] = typer.Option(None, help="time between cycles, e.g. 5h (default: run.every)"),
    once: bool = typer.Option(False, help="one cycle now, then exit"),
    max_cycles: Optional[int] = typer.Option(None, min=1, help="stop after this many cycles"),
) -> None:
    """Logs since the last cycle -> rewards -> train the current policy -> eval gate -> hot-swap if it passes.
    One JSON line per cycle."""
    if ctx.invoked_subcommand is not None:
        return
    from opencomposer.realtime.config import RealtimeConfig, parse_duration
    from opencomposer.realtime.cycle import RealtimeLoop

    try:
        if config is None:
            raise ConfigError("realtime: give --config FILE (e.g. configs/realtime/realtime.toml), or a subcommand: report, users")
        cfg = load_for(config, RealtimeConfig)
        cfg.gate.backend = sandbox_backend(None, None, config, "gate.backend", cfg.gate.backend)  # candidates' episodes
        every_s = parse_duration(every or cfg.run.every, "--every")
        loop = RealtimeLoop(cfg, log=lambda m: err.print(m, highlight=False, markup=False))
        loop.run(every_s, once, on_cycle=emit, max_cycles=max_cycles)
    except _realtime_errors() as e:
        fail(e)


@realtime_app.command("report")
def realtime_report(
    log_dir: Path = typer.Option(..., help="serve --log-dir"),
    since: Optional[str] = typer.Option(None, help="unix time or ISO date of the first record"),
    until: Optional[str] = typer.Option(None, help="unix time or ISO date after the last record (default: now)"),
    threshold: float = typer.Option(0.5, min=0.0, max=1.0, help="classifier probability of a dissatisfied follow-up"),
) -> None:
    """A/B report per arm: edit persistence, dissatisfied follow-ups, latency p50/p95, with counts."""
    from opencomposer.inference.server.session_log import read_window
    from opencomposer.realtime.ab_report import ab_report
    from opencomposer.realtime.classifier import default_classifier

    def when(v: Optional[str], flag: str) -> Optional[float]:
        if v is None:
            return None
        try:
            return float(v)
        except ValueError:
            from datetime import datetime, timezone
            try:
                d = datetime.fromisoformat(v)
            except ValueError:
                raise ConfigError(f"{flag}: {v!r} is neither a unix time nor an ISO date") from None
            return (d if d.tzinfo else d.replace(tzinfo=timezone.utc)).timestamp()

    try:
        window = read_window(log_dir, when(since, "--since") or 0.0, when(until, "--until"))
        rep = ab_report(window, default_classifier(), threshold)
    except known_errors() + (FileNotFoundError,) as e:
        fail(e)
    table = Table("arm", "sessions", "completions", "edit persistence", "dissatisfied", "p50 s", "p95 s")
    for arm, m in rep["arms"].items():
        f = lambda x, pct=False: "-" if x is None else (f"{x:.1%}" if pct else f"{x:.3g}")  # noqa: E731
        table.add_row(arm, str(m["sessions"]), str(m["completions"]),
                      f"{f(m['edit_persistence'], True)} ({m['edits_kept']}/{m['edits_kept'] + m['edits_reverted']})",
                      f"{f(m['dissatisfied_rate'], True)} ({m['dissatisfied']}/{m['follow_ups']})",
                      f(m["latency_p50_s"]), f(m["latency_p95_s"]))
    err.print(table)
    emit(rep)


@realtime_app.command("users")
def realtime_users(
    base_url: str = typer.Option(..., help="the served agent, e.g. http://127.0.0.1:8000/v1"),
    model: str = typer.Option(..., help="the served model name"),
    suite: str = typer.Option("smoke", help="eval suite (name, TOML or task dir) the users' tasks come from"),
    sessions: int = typer.Option(8, min=1),
    users: int = typer.Option(6, min=1, help="distinct simulated users (personas)"),
    backend: str = typer.Option("auto", help="of the users' episodes: " + SANDBOX_HELP),
    max_turns: int = typer.Option(4, min=1),
    max_tokens: Optional[int] = typer.Option(None, min=1, help="max_tokens per model turn"),
    temperature: float = typer.Option(0.7, min=0.0),
    concurrency: int = typer.Option(4, min=1),
    seed: int = typer.Option(0),
    token: Optional[str] = typer.Option(None, envvar="OPENCOMPOSER_SERVE_TOKEN",
                                        help="the server's --api-token, which /v1/feedback needs when it has one"),
) -> None:
    """Simulated users drive the served agent through the harness and send feedback events."""
    from opencomposer.config import AgentConfig
    from opencomposer.eval.suite import load_suite
    from opencomposer.realtime.users import UserPopulation

    try:
        backend = sandbox_backend(backend, "--backend")
        pop = UserPopulation(load_suite(suite).tasks, n_users=users, seed=seed)
        rep = pop.run(base_url, model, sessions, backend, AgentConfig(max_turns=max_turns, max_seconds=600),
                      concurrency=concurrency, temperature=temperature, max_tokens=max_tokens, token=token)
    except _realtime_errors() as e:
        fail(e)
    rep.pop("outcomes")
    emit(rep)
