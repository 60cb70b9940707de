"""A task environment described, its wheels carried, and rebuilt offline: the env half of ``tasks pack``.

    rec = describe_env(Path("tasks/_envs/toolz-1.2.0"))        # {"python": "3.11.7", "installed": [...]}
    wheels = fetch_wheels(rec["installed"], Path("w/"), python_version="3.12")   # here, with network
    rebuild_env(Path("out/_envs/toolz-1.2.0"), Path("w/"), rec, ["toolz"])      # there, with none

An env (``envs.build_env``) is a venv holding the library's test requirements, never the library
itself: tasks import it from their workspace (``environment.pythonpath``). So what an env needs
is its Python version and its installed distributions, read from its site-packages
(``importlib.metadata``: the env has no pip to ask, ``envs.strip_tools`` removed it).
``fetch_wheels`` downloads each pinned distribution as a wheel (``pip download --no-deps
--only-binary :all:``, for another machine's Python with ``python_version``/``platform``); one
published only as an sdist is built into a wheel here (``pip wheel --no-deps``: right for a
pure-python one). ``rebuild_env`` makes a venv without pip and installs exactly those wheels into
it with this interpreter's pip (``--python``), ``--no-index``: the network is never touched. The
result must hold exactly the recorded distributions, and must not import the library.

Test: ``pytest tests/unit/tasks/test_pack.py``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.utils import (
    InvalidWheelFilename,
    canonicalize_name,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from opencomposer.tasks.envs import EnvError, env_alone, strip_tools


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _site(env: Path) -> Path | None:
    return next(iter(sorted((env / "lib").glob("python3*/site-packages"))), None)


def env_python(env: Path) -> str:
    """The Python version of the venv at ``env`` ("3.11.7"), from pyvenv.cfg or its lib/ dir."""
    cfg = env / "pyvenv.cfg"
    if cfg.is_file():
        for line in cfg.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() in ("version_info", "version") and value.strip():
                return value.strip()
    site = _site(env)
    if site is None:
        raise EnvError(f"{env}: not a Python environment (no pyvenv.cfg, no lib/python3*/site-packages)")
    return site.parent.name.removeprefix("python")


def installed(env: Path) -> list[str]:
    """``name==version`` of every distribution in the env's site-packages, sorted by name."""
    site = _site(env)
    if site is None:
        raise EnvError(f"{env}: no lib/python3*/site-packages; expected a Python environment")
    pins = {}
    for d in importlib.metadata.distributions(path=[str(site)]):
        name = d.metadata["Name"]
        if name:
            pins.setdefault(canonicalize_name(name), f"{canonicalize_name(name)}=={d.version}")
    return [pins[k] for k in sorted(pins)]


def describe_env(env: Path) -> dict:
    """What rebuilding ``env`` needs: its Python version and its installed distributions."""
    return {"python": env_python(env), "installed": installed(env)}


def _pin(req: str) -> tuple[str, str]:
    name, _, version = req.partition("==")
    try:
        version = str(Version(version))
    except InvalidVersion:
        pass
    return canonicalize_name(name), version


def _wheel_pin(path: Path) -> tuple[str, str] | None:
    try:
        name, version, _, _ = parse_wheel_filename(path.name)
    except InvalidWheelFilename:
        return None
    return canonicalize_name(name), str(version)


def _have(dest: Path) -> dict[tuple[str, str], Path]:
    return {pin: p for p in sorted(dest.glob("*.whl")) if (pin := _wheel_pin(p))}


def wheelhouse_pins(find_links: list[Path] | None) -> tuple[Path | None, set[tuple[str, str]]]:
    """The one ``find_links`` dir (of exactly one) and the ``(name, version)`` of each wheel file in it; (None,
    empty) otherwise. An env all of whose pins are there installs straight from it: no ``fetch_wheels`` pip call
    per env (68 envs: 135 s here); pip still picks among its files the wheel that fits the interpreter, and says
    so when none does."""
    if not find_links or len(find_links) != 1 or not Path(find_links[0]).is_dir():
        return None, set()
    return Path(find_links[0]), {pin for p in Path(find_links[0]).glob("*.whl") if (pin := _wheel_pin(p))}


def has_pins(reqs: list[str], pins: set[tuple[str, str]]) -> bool:
    return all(_pin(r) in pins for r in reqs)


def fetch_wheels(reqs: list[str], dest: Path, python_version: str | None = None,
                 platform: list[str] | None = None, find_links: list[Path] | None = None,
                 timeout: float = 900.0) -> dict[str, bool]:
    """A wheel in ``dest`` for every pinned ``name==version`` of ``reqs``; returns wheel file name ->
    whether it was built here from an sdist. ``find_links``: take them from these dirs, not the index."""
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    source = (["--no-index"] + [f"--find-links={p}" for p in find_links]) if find_links else []
    target = (["--python-version", python_version] if python_version else []) + \
        [a for p in platform or [] for a in ("--platform", p)]
    download = pip + ["download", "--no-deps", "-d", str(dest)] + source
    built: dict[str, bool] = {}
    if reqs and _run(download + target + ["--only-binary", ":all:"] + reqs, timeout).returncode:
        for req in reqs:  # one at a time: which ones have no wheel, and why
            if _pin(req) in _have(dest):
                continue
            r = _run(download + target + ["--only-binary", ":all:", req], timeout)
            if r.returncode == 0:
                continue
            sdists = dest / ".sdists"
            s = _run(pip + ["download", "--no-deps", "--no-binary", ":all:", "-d", str(sdists)] + source + [req], timeout)
            files = sorted(sdists.glob("*")) if s.returncode == 0 else []
            w = _run(pip + ["wheel", "--no-deps", "-w", str(dest), str(files[-1])], timeout) if files else s
            if w.returncode:
                raise EnvError(f"{req}: no wheel for {'Python ' + python_version if python_version else 'this Python'}"
                               f"{' on ' + ','.join(platform) if platform else ''}, and building one from its "
                               f"sdist failed: {(r.stderr + w.stderr).strip()[-1500:]}")
            new = _have(dest).get(_pin(req))
            if new is not None:
                built[new.name] = True
    have = _have(dest)
    missing = [r for r in reqs if _pin(r) not in have]
    if missing:
        raise EnvError(f"pip gave no wheel for {missing} (expected one per pinned distribution in {dest})")
    return {have[_pin(r)].name: built.get(have[_pin(r)].name, False) for r in reqs}


def clean_env() -> dict[str, str]:
    """This process's environment without what would make pip or the env's Python see packages
    outside the env (PYTHONPATH, user site, pip's target/prefix/user settings) or reach an index."""
    env = {k: v for k, v in env_alone().items()
           if k not in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TARGET", "PIP_PREFIX", "PIP_USER", "PIP_FIND_LINKS")}
    return {**env, "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}


def interpreter_version(python: str) -> str | None:
    """``X.Y`` of the interpreter ``python``; None when it does not run."""
    r = _run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], 60)
    return r.stdout.strip() if r.returncode == 0 else None


def rebuild_env(dest: Path, wheels: Path, record: dict, packages: list[str], python: str = sys.executable,
                timeout: float = 900.0) -> Path:
    """A venv at ``dest`` holding exactly ``record["installed"]``, installed from ``wheels`` with the
    index disabled; refused when ``python`` is not the recorded X.Y or the env imports a package of
    ``packages`` (the library under test lives in the workspaces only)."""
    want = record.get("target_python") or ".".join(record["python"].split(".")[:2])
    have = interpreter_version(python)
    if have != want:
        raise EnvError(f"{dest}: the pack's environment needs Python {want}; {python} is {have or 'not runnable'} "
                       f"(give an interpreter of Python {want}, e.g. --python python{want}, or pack with "
                       f"--python-version {have or 'X.Y'})")
    r = _run([python, "-m", "venv", "--without-pip", str(dest)], 300)
    if r.returncode:
        raise EnvError(f"{dest}: venv creation failed: {r.stderr.strip()[-2000:]}")
    reqs = list(record["installed"])
    env = clean_env()
    if reqs:
        # --ignore-installed: what a PYTHONPATH or user site shows pip is not in the env, install it anyway
        r = _run([sys.executable, "-m", "pip", "--python", str(dest / "bin" / "python"), "install", "--no-deps",
                  "--no-index", "--ignore-installed", f"--find-links={wheels}", "--no-cache-dir", "-q",
                  "--disable-pip-version-check", *reqs], timeout, env)
        if r.returncode:
            raise EnvError(f"{dest}: installing the carried wheels (index disabled) failed:\n{r.stderr.strip()[-3000:]}")
    strip_tools(dest, reqs)
    got = installed(dest)
    if sorted(got) != sorted(_norm(reqs)):
        extra, lack = sorted(set(got) - set(_norm(reqs))), sorted(set(_norm(reqs)) - set(got))
        raise EnvError(f"{dest}: the rebuilt env differs from the packed one: extra {extra}, missing {lack}")
    for pkg in packages:
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", pkg) and \
                _run([str(dest / "bin" / "python"), "-c", f"import {pkg}"], 120, env).returncode == 0:
            raise EnvError(f"{dest}: the library's package {pkg!r} is importable from the rebuilt env itself; "
                           "tasks would leak the deleted code")
    return dest


def _norm(reqs: list[str]) -> list[str]:
    return ["==".join(_pin(r)) for r in reqs]


def rebuild_envs(todo: list[tuple[Path, Path, dict]], python: str = sys.executable, timeout: float = 900.0,
                 staged: tuple[Path, Path] | None = None) -> None:
    """``rebuild_env(dest, wheels, record)`` for each of ``todo``, several at once: each is a venv and an
    offline pip install, subprocesses waiting on disk (38 of them took 2 of the 2.7 minutes of a pack's
    unpack one after another, session 33). The first in ``todo``'s order that failed raises; ``staged``
    (staging dir, final dir) names it where it will be, not where it was built."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(todo)))) as pool:
        futures = [pool.submit(rebuild_env, dest, wheels, record, record.get("packages", []), python, timeout)
                   for dest, wheels, record in todo]
    for f in futures:
        err = f.exception()
        if isinstance(err, EnvError) and staged is not None:
            raise EnvError(str(err).replace(str(staged[0]), str(staged[1]))) from None
        f.result()
