"""Harbor task directories -> tasks: the import half of the Harbor format.

    opencomposer tasks import harbor harbor-tasks/ --out tasks/

(Export, tasks -> Harbor, is ``harbor_export.py``.)

A Harbor task is ``instruction.md``, ``task.toml`` (``[metadata]``, ``[verifier]``,
``[agent]``, ``[environment]``), ``environment/Dockerfile`` (+ build context),
``tests/test.sh`` (uploaded to ``/tests``, writes ``/logs/verifier/reward.txt``) and
``solution/solve.sh``.

Import runs a task only where a sandbox here can give it its environment: a Dockerfile
made of ``FROM python:*``, ``WORKDIR``, ``COPY``/``ADD`` from the build context,
``ENV`` and ``RUN pip install ...`` becomes a workspace (what was copied into the
workdir) plus a Python env with those packages. Any other instruction (another base
image, ``apt-get``, ...) needs Docker, which this machine lacks: the task is *skipped*
with the Dockerfile line as the reason. Hidden tests are ``tests/files/**`` (our
export's layout) or else the ``tests/*.py`` files, placed at the workspace root. The gold
patch is ``solution/gold.patch`` or else what ``solve.sh`` changes, run in a sandbox;
FAIL_TO_PASS/PASS_TO_PASS are read from ``[metadata.opencomposer]`` or else measured:
tests failing before and passing after the solution, and tests passing in both.

An imported task is untrusted: every file it is read from (``instruction.md``, the
Dockerfile's build context and ``-r`` files, ``tests/``, ``solution/``) must resolve inside
its directory, and the env its metadata names (``metadata.opencomposer.env``) is used only
when it lies in ``OUT/_envs`` (``format.env_outside``); otherwise the item fails with the
key and the path. The task written passes ``format.check_paths`` (``assemble.write_task_dir``).

Test: ``pytest tests/integration/test_task_formats.py tests/unit/tasks/sources/test_confine.py``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import tempfile
import time
import tomllib
from pathlib import Path

from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks import leakage
from opencomposer.tasks.envs import EnvError, build_env
from opencomposer.tasks.format import (
    ENVS,
    EnvironmentInfo,
    FeatureInfo,
    SourceInfo,
    TaskFormatError,
    TaskMeta,
    TestsInfo,
    check_task_id,
    env_outside,
)
from opencomposer.tasks.layout import inspect_project
from opencomposer.tasks.sources import Check, ImportReport, ItemError, ItemSkipped
from opencomposer.tasks.sources.assemble import tree_files, write_task_dir
from opencomposer.tasks.testrun import DEFAULT_COMMAND, run_tests

EXTRA = "opencomposer"  # our metadata table in task.toml: [metadata.opencomposer]
_PY_BASE = re.compile(r"^python:3(\.\d+)?([-.][\w.-]+)?$")
_PIP = re.compile(r"^(python3? -m )?pip3? install\b")


# --------------------------------------------------------------------------- the Dockerfile


def read_dockerfile(path: Path) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    out, buf, start = [], "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1].rstrip() + " "
            continue
        buf += line
        op, _, args = buf.partition(" ")
        out.append((start, op.upper(), args.strip()))
        buf = ""
    return out


def plan_environment(env_dir: Path) -> tuple[str, dict[str, str], list[str], dict[str, str]]:
    """Read ``environment/Dockerfile`` into (workdir, copies src->dest, pip requirements, ENV),
    or raise ItemSkipped naming the first line only Docker can carry out."""
    dockerfile = env_dir / "Dockerfile"
    if (env_dir / "docker-compose.yaml").exists() or (env_dir / "docker-compose.yml").exists():
        raise ItemSkipped(f"{env_dir}/docker-compose.yaml: a multi-container environment needs Docker, "
                          "which this machine lacks")
    if not dockerfile.is_file():
        raise ItemError(f"{dockerfile}: missing; a Harbor task needs environment/Dockerfile")

    def docker(n: int, text: str) -> ItemSkipped:
        return ItemSkipped(f"{dockerfile}:{n}: `{text[:80]}` needs a Docker build, which this machine lacks "
                           "(only FROM python:*, WORKDIR, COPY/ADD, ENV and RUN pip install run here)")

    workdir, copies, reqs, envs, consumed = "/", {}, [], {}, set()
    for n, op, args in read_dockerfile(dockerfile):
        if op == "FROM":
            image = args.split()[0] if args else ""
            if not _PY_BASE.match(image):
                raise docker(n, f"FROM {args}")
        elif op == "WORKDIR":
            workdir = args if args.startswith("/") else f"{workdir.rstrip('/')}/{args}"
        elif op in ("COPY", "ADD"):
            parts = [p for p in shlex.split(args) if not p.startswith("--")]
            if len(parts) != 2 or parts[0].startswith(("http:", "https:")):
                raise docker(n, f"{op} {args}")
            src, dest = parts
            dest = dest if dest.startswith("/") else f"{workdir.rstrip('/')}/{dest}"
            copies[src] = dest
        elif op == "ENV":
            k, _, v = args.replace("=", " ", 1).partition(" ")
            envs[k] = v.strip().strip('"')
        elif op == "RUN" and _PIP.match(args) and not re.search(r"[;&|]", args):
            words = shlex.split(args)[2:] if args.startswith("pip") else shlex.split(args)[4:]
            i = 0
            while i < len(words):
                w = words[i]
                if w in ("-r", "--requirement"):
                    req_file = _context_file(words[i + 1], copies, workdir, env_dir)
                    consumed.add(req_file)
                    if not _within(req_file, env_dir):
                        raise ItemError(f"{dockerfile}:{n}: requirements file {words[i + 1]} resolves to "
                                        f"{req_file.resolve()}, outside the build context environment/")
                    if not req_file.is_file():
                        raise ItemError(f"{dockerfile}:{n}: requirements file {words[i + 1]} not in environment/")
                    reqs += [l.split("#")[0].strip() for l in req_file.read_text().splitlines()
                             if l.split("#")[0].strip() and not l.startswith("-")]
                    i += 1
                elif not w.startswith("-"):
                    reqs.append(w)
                i += 1
        elif op in ("LABEL", "ARG", "EXPOSE", "CMD", "ENTRYPOINT", "USER", "SHELL"):
            continue
        else:
            raise docker(n, f"{op} {args}")
    # a requirements file copied only for `pip install -r` is not part of the workspace
    copies = {k: v for k, v in copies.items() if env_dir / k not in consumed or v.startswith(workdir.rstrip("/") + "/")}
    return workdir, copies, reqs, envs


def _within(path: Path, root: Path) -> bool:
    """Whether ``path`` resolves (symlinks followed) inside ``root``."""
    real, base = path.resolve(), root.resolve()
    return real == base or base in real.parents


def _own_file(src: Path, rel: str) -> Path:
    """``src/rel``, refused (ItemError) when it resolves outside the task dir ``src``."""
    p = src / rel
    if p.exists() and not _within(p, src):
        raise ItemError(f"{p}: follows a symlink to {p.resolve()}, outside the task directory {src.resolve()}; "
                        f"expected the task's own {rel}")
    return p


def _context_file(path: str, copies: dict[str, str], workdir: str, env_dir: Path) -> Path:
    """The build-context file an image path came from (via an earlier COPY), else ``path`` in the context."""
    target = path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"
    for src, dest in copies.items():
        if dest == target or (dest.endswith("/") and dest + Path(src).name == target):
            return env_dir / src
    return env_dir / path


def build_workspace(env_dir: Path, workdir: str, copies: dict[str, str], dest: Path) -> None:
    """Carry out the COPY lines that land in the workdir; others need a real image."""
    dest.mkdir(parents=True)
    wd = workdir.rstrip("/") + "/"
    for src, target in copies.items():
        s = (env_dir / src).resolve()
        if not s.exists() or env_dir.resolve() not in (s, *s.parents):
            raise ItemError(f"{env_dir / 'Dockerfile'}: COPY {src}: not in the build context environment/")
        if target.rstrip("/") + "/" == wd:
            rel = ""
        elif target.startswith(wd):
            rel = target[len(wd):]
        else:
            raise ItemSkipped(f"{env_dir / 'Dockerfile'}: COPY {src} {target}: files outside the workdir "
                              f"{workdir} need a Docker image")
        if s.is_dir():
            shutil.copytree(s, dest / rel, dirs_exist_ok=True, symlinks=True)
        else:
            t = dest / rel / s.name if (not rel or rel.endswith("/")) else dest / rel
            t.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, t)


# --------------------------------------------------------------------------- import


def _hidden(tests: Path) -> dict[str, bytes]:
    if (tests / "files").is_dir():
        return tree_files(tests / "files")
    found = {}
    for p in sorted(tests.rglob("*.py")):
        if not _within(p, tests):
            raise ItemError(f"{p}: follows a symlink to {p.resolve()}, outside {tests.resolve()}; "
                            "expected the task's own test files")
        found[p.relative_to(tests).as_posix()] = p.read_bytes()
    return found


def solve_patch(ws: Path, env: Path, solve_sh: str, pythonpath: list[str]) -> str:
    """What ``solve.sh`` changes in the workspace, as a git diff (run in a local sandbox)."""
    with make_sandbox(SandboxSpec(ws, env, pythonpath), "local") as sb:
        sb.write_file(".harbor_solve.sh", solve_sh.encode())
        r = sb.exec(["sh", "-c", "sh .harbor_solve.sh && rm .harbor_solve.sh"], timeout=300)
        if r.exit_code:
            raise ItemError(f"solution/solve.sh: exits {r.exit_code}: {r.output.strip()[-400:]}")
        d = sb.exec(["sh", "-c", "git add -A && git -c core.quotepath=off diff --cached --no-color"],
                    timeout=60, max_output=50_000_000)
        if d.exit_code or not d.output.strip():
            raise ItemError("solution/solve.sh: changes nothing in the workspace (no gold patch)")
        return d.output


def measure_tests(ws: Path, env: Path, hidden: dict[str, bytes], gold: str, pythonpath: list[str],
                  targets: list[str]) -> tuple[list[str], list[str]]:
    """FAIL_TO_PASS (fail before, pass after the gold patch) and PASS_TO_PASS (pass in both)."""
    with make_sandbox(SandboxSpec(ws, env, pythonpath), "local") as sb:
        for rel, data in hidden.items():
            sb.write_file(rel, data)
        before = run_tests(sb, targets)
        sb.reset()
        r = sb.exec(["patch", "-p1", "-s", "--forward"], stdin=gold.encode(), timeout=60)
        if r.exit_code:
            raise ItemError(f"gold patch does not apply to the workspace: {r.output.strip()[:300]}")
        for rel, data in hidden.items():
            sb.write_file(rel, data)
        after = run_tests(sb, targets)
    f2p = sorted(t for t in after.passed() if t not in before.passed())
    p2p = sorted(t for t in after.passed() if t in before.passed())
    return f2p, p2p


def harbor_task(src: Path, out: Path, env: Path | None) -> Path:
    for part in ("task.toml", "instruction.md", "environment", "tests", "tests/test.sh", "tests/files",
                 "solution", "solution/gold.patch", "solution/solve.sh"):
        _own_file(src, part)
    toml_path = src / "task.toml"
    try:
        conf = tomllib.loads(toml_path.read_text())
    except FileNotFoundError:
        raise ItemError(f"{toml_path}: missing; a Harbor task needs task.toml") from None
    except tomllib.TOMLDecodeError as e:
        raise ItemError(f"{toml_path}: garbled, not valid TOML: {e}") from None
    instr_path = src / "instruction.md"
    instruction = instr_path.read_text().strip() if instr_path.is_file() else ""
    if not instruction:
        raise ItemError(f"{instr_path}: missing or empty; a Harbor task needs an instruction")
    if not (src / "tests" / "test.sh").is_file():
        raise ItemError(f"{src / 'tests/test.sh'}: missing; a Harbor task needs a verifier script")
    workdir, copies, reqs, envs = plan_environment(src / "environment")
    hidden = _hidden(src / "tests")
    if not hidden:
        raise ItemSkipped(f"{src / 'tests'}: no Python test files; only pytest verifiers are graded here")
    extra = conf.get("metadata", {}).get(EXTRA, {})
    tid = re.sub(r"[^A-Za-z0-9_.-]+", "_", extra.get("id") or src.name)
    try:
        check_task_id(tid, f"{toml_path}: metadata.{EXTRA}")
    except TaskFormatError as e:
        raise ItemError(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="harbor-") as tmp:
        ws = Path(tmp) / "ws"
        build_workspace(src / "environment", workdir, copies, ws)
        layout = inspect_project(ws)
        pythonpath = extra.get("pythonpath") or _pythonpath(envs.get("PYTHONPATH", ""), workdir) or layout.pythonpath
        known = extra.get("env")  # the env a task we exported was made with, if on this machine
        if env is None and known and Path(known, "bin", "python").exists():
            env = Path(known)
            why = env_outside(out / tid, os.path.relpath(env.absolute(), (out / tid).absolute()))
            if why:
                raise ItemError(f"{toml_path}: key 'metadata.{EXTRA}.env': path {known!r} {why}; "
                                f"an imported task's env must already be in {out / ENVS} (or pass --env)")
        if env is None:
            layout.requirements = reqs or ["pytest"]
            env = build_env(layout, tid, out / "_envs" / f"harbor-{tid}")
        if (src / "solution" / "gold.patch").is_file():
            gold = (src / "solution" / "gold.patch").read_bytes().decode("utf-8")  # CRLF lines kept
        elif (src / "solution" / "solve.sh").is_file():
            leakage.fresh_git(ws)
            gold = solve_patch(ws, env, (src / "solution" / "solve.sh").read_text(), pythonpath)
            shutil.rmtree(ws / ".git")
        else:
            raise ItemError(f"{src / 'solution'}: no solve.sh or gold.patch; a task needs a reference solution")
        targets = extra.get("targets") or sorted(r for r in hidden if r.endswith(".py") and
                                                 Path(r).name.startswith("test"))
        if extra.get("fail_to_pass"):
            f2p, p2p = extra["fail_to_pass"], extra.get("pass_to_pass", [])
        else:
            f2p, p2p = measure_tests(ws, env, hidden, gold, pythonpath, targets)
            if not f2p:
                raise ItemError(f"{src}: no test fails before the reference solution and passes after it")
        feat = extra.get("feature") or {"level": "harbor", "file": _first_file(gold), "symbol": "", "lines_removed": 0}
        meta = TaskMeta(
            id=tid,
            source=SourceInfo(**extra["source"]) if extra.get("source") else SourceInfo(
                kind="harbor", spec=str(src.name), package=extra.get("package", "")),
            feature=FeatureInfo(**feat),
            environment=EnvironmentInfo(pythonpath=pythonpath),
            tests=TestsInfo(command=extra.get("command", DEFAULT_COMMAND),
                            files=extra.get("files") or sorted({t.split("::", 1)[0] for t in targets}),
                            targets=targets,
                            fail_to_pass=f2p, pass_to_pass=p2p,
                            timeout=float(conf.get("verifier", {}).get("timeout_sec", 300.0))),
        )
        return write_task_dir(out, meta, instruction, ws, hidden, gold, env=env)


def _pythonpath(value: str, workdir: str) -> list[str]:
    wd = workdir.rstrip("/") + "/"
    out = []
    for p in filter(None, value.split(":")):
        if p.rstrip("/") + "/" == wd:
            out.append(".")
        elif p.startswith(wd):
            out.append(p[len(wd):])
    return out


def _first_file(patch: str) -> str:
    m = re.search(r"^\+\+\+ b/(\S+)", patch, re.MULTILINE)
    return m.group(1) if m else ""


def import_harbor(root: Path, out: Path, env: Path | None = None, check: Check | None = None) -> ImportReport:
    """Import every Harbor task under ``root`` (a task dir or a dir of them). ``check``: validates
    each task written (the caller passes ``grading.check.check_task`` bound to a backend); a task
    that fails it is removed and counted as failed."""

    t0 = time.time()
    root, out = Path(root), Path(out)
    report = ImportReport(f"harbor:{root}")
    if not root.is_dir():
        from opencomposer.tasks.pypi import SourceError
        raise SourceError(f"{root}: not a directory of Harbor tasks")
    dirs = [root] if (root / "task.toml").exists() else sorted(
        p for p in root.iterdir() if p.is_dir() and (p / "task.toml").exists() and not p.name.startswith(("_", ".")))
    for d in dirs:
        try:
            path = harbor_task(d, out, env)
        except ItemSkipped as e:
            report.skipped[d.name] = str(e)
            continue
        except ItemError as e:
            report.failed[d.name] = str(e)
            continue
        except (ValueError, EnvError) as e:  # e.g. its env cannot be built: this task fails, the rest go on
            report.failed[d.name] = f"{d}: {type(e).__name__}: {e}"
            continue
        if check:
            res = check(path)
            if not res.ok:
                shutil.rmtree(path, ignore_errors=True)
                report.failed[d.name] = f"{d}: task fails its check: {'; '.join(res.problems)[:400]}"
                continue
        report.ok.append(path.name)
    report.seconds = time.time() - t0
    return report
