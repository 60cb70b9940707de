"""The task factory on a machine without network (the GPU machine's 16-64 cores instead of this VM's 2).

    HERE:   python benchmarks/factory_offline.py prepare configs/tasks/lines-extra.toml --dest .gpuf \
                [--python-version 3.12]                # every library's sdist + the wheels its tests need
    THERE:  python3 benchmarks/factory_offline.py run configs/tasks/lines-extra.toml --dir /tmp/factory \
                --out /tmp/made/lines-extra --shards 4 --workers 4 --deadline-s 500    # call again to go on
            python3 benchmarks/factory_offline.py merge --out /tmp/made/lines-extra  # shards -> one task set

``prepare`` downloads each library's sdist (``tasks.pypi.fetch_sdist``) into ``DEST/sdists``, runs
the install recipe here (``tasks.install.install_repo``: discovered requirements, then repairs
for the modules the suite could not import, verified by a suite run) and puts into
``DEST/wheels`` the wheels of all it asked for and ended up installing, dependencies included,
for the target Python and Linux platforms (``pip download --only-binary``; a requirement with no
wheel is built here with ``pip wheel``, right for the pure-Python ones; one that cannot be had
is listed and its library may fail there). ``DEST/libraries.json`` records each library's
sdist and requirements. Files are split into parts by ``carry_parts``-style size limits by the
caller (``learn_device.sh factory-prepare`` puts them in .gpuf* folders).

``run`` starts ``opencomposer tasks make --config`` in ``--shards`` processes at once (libraries
dealt round-robin, ``--workers`` threads each), every library from its carried sdist, pip held to
the carried wheels (``PIP_NO_INDEX``, ``PIP_FIND_LINKS``): the factory and its install recipe run
unchanged, only offline. Each shard writes ``OUT/shard-N`` and resumes from its journal, so a call
that ends at ``--deadline-s`` (the processes are stopped) loses at most the tasks in flight.
``merge`` moves every shard's tasks and environments into ``OUT`` itself, once all are done.

Repair rounds that need a distribution not carried fail there (the library is reported with the
reason and the factory goes on), so a library may yield fewer tasks than here.

Prints one JSON line last. Test: ``pytest tests/bench/test_factory_offline.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import tomli_w
from packaging.utils import canonicalize_name

from opencomposer.config import ConfigError
from opencomposer.paths import atomic_write_text
from opencomposer.tasks import packenv
from opencomposer.tasks.envs import TOOLS, EnvError
from opencomposer.tasks.factory import FactoryConfig
from opencomposer.tasks.install import InstallError, discover, install_repo
from opencomposer.tasks.layout import inspect_project
from opencomposer.tasks.pypi import fetch_sdist, unpack_sdist

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
ENVS = "_envs"


def load_factory(path: Path) -> FactoryConfig:
    try:
        return FactoryConfig.model_validate(tomllib.loads(Path(path).read_text()))
    except (OSError, tomllib.TOMLDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: not a factory config ({e})") from None


def _pip(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                          capture_output=True, text=True, timeout=timeout)


def fetch_for(reqs: list[str], pins: list[str], wheels: Path, python_version: str | None,
              platforms: list[str]) -> list[str]:
    """Into ``wheels``: each exact pin the recipe installed here (``packenv.fetch_wheels``: a wheel
    for the target, or one built here from a pure-Python sdist), then ``reqs`` with their
    dependencies as the target resolves them (its markers may ask for more than this Python did).
    Returns what could not be had (each tried alone after its set failed)."""
    platform = platforms if python_version else None
    missing = []
    try:
        packenv.fetch_wheels(pins, wheels, python_version, platform)
    except EnvError:
        for pin in pins:
            try:
                packenv.fetch_wheels([pin], wheels, python_version, platform)
            except EnvError:
                missing.append(pin)
    target = (["--python-version", python_version, "--implementation", "cp"] if python_version else []) + \
        [a for p in platform or [] for a in ("--platform", p)]
    pinned_file = wheels.parent / ".pins.txt"  # the closure takes the versions installed here where they fit
    pinned_file.write_text("".join(f"{p}\n" for p in pins if p not in missing))
    base = ["download", "-d", str(wheels), "--only-binary", ":all:", "-c", str(pinned_file), *target]
    if reqs and _pip(*base, *reqs).returncode:
        pinned = {canonicalize_name(p.split("==")[0]) for p in pins if p not in missing}
        for req in reqs:  # a requirement whose pin is carried is had, whatever its range's resolution said
            if _pip(*base, req).returncode and canonicalize_name(re.split(r"[\s\[<>=!~;]", req, 1)[0]) not in pinned:
                missing.append(req)
    return missing


def prune_wheels(wheels: Path, libs: list[dict]) -> list[str]:
    """Remove each wheel of a distribution that some library pinned at other versions only (a
    requirement's closure that resolved past every pin): each library's recipe asks for what it
    installed here, so the pinned versions serve it; returns the files removed."""
    pinned: dict[str, set[str]] = {}
    for lib in libs:
        for pin in lib.get("installed_here", []):
            name, _, version = pin.partition("==")
            pinned.setdefault(canonicalize_name(name), set()).add(version)
    gone = []
    for whl in sorted(wheels.glob("*.whl")):
        name, version = whl.name.split("-")[:2]
        versions = pinned.get(canonicalize_name(name))
        if versions and version not in versions:
            whl.unlink()
            gone.append(whl.name)
    return gone


def prepare(config: Path, dest: Path, python_version: str | None, platforms: list[str]) -> dict:
    cfg = load_factory(config)
    (dest / "sdists").mkdir(parents=True, exist_ok=True)
    (dest / "wheels").mkdir(parents=True, exist_ok=True)
    rec_path = dest / "libraries.json"
    libs = json.loads(rec_path.read_text())["libraries"] if rec_path.is_file() else []
    done = {x["spec"] for x in libs}  # a prepare stopped midway goes on from the libraries recorded
    t0 = time.time()
    for lib in cfg.libraries:
        if lib.spec in done:
            continue
        ref = fetch_sdist(lib.spec)
        shutil.copy2(ref.path, dest / "sdists" / ref.path.name)
        with tempfile.TemporaryDirectory() as tmp:
            root = unpack_sdist(ref.path, Path(tmp) / "src")
            layout = inspect_project(root)
            plan = discover(root, layout)
            # the install recipe run here, repairs and all (one suite run or more): what it ended up
            # installing is what the factory there will ask pip for, so those wheels go too
            try:
                inst = install_repo(layout, ref.name, Path(tmp) / "env", "local", cfg.factory.test_timeout)
                installed = json.loads((inst.env / "env.json").read_text()).get("installed", [])
                how = inst.method
            except (InstallError, EnvError) as e:
                installed, how = [], f"failed here: {str(e).splitlines()[0][:200]}"
        reqs = list(dict.fromkeys([*plan.requirements, "pytest"]))
        pins = [x for x in installed if "==" in x and canonicalize_name(x.split("==")[0]) not in TOOLS]
        missing = fetch_for(reqs, pins, dest / "wheels", python_version, platforms)
        libs.append({"spec": lib.spec, "sdist": ref.path.name, "requirements": reqs, "installed_here": pins,
                     "install_here": how, "missing": missing})
        print(json.dumps({"library": lib.spec, "requirements": len(reqs), "installed_here": len(pins),
                          "install_here": how, "missing": missing}), flush=True)
        record = {"config": str(config), "python_version": python_version, "platforms": platforms, "libraries": libs}
        atomic_write_text(rec_path, json.dumps(record, indent=1))  # after each library: what is here is whole
    pruned = prune_wheels(dest / "wheels", libs)
    (dest / ".pins.txt").unlink(missing_ok=True)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    return {"prepared": str(dest), "libraries": len(libs), "missing": {x["spec"]: x["missing"] for x in libs if x["missing"]},
            "wheels": len(list((dest / "wheels").glob("*.whl"))), "pruned": len(pruned), "bytes": size,
            "seconds": round(time.time() - t0, 1)}


def shard_configs(config: Path, src: Path, out: Path, shards: int, workers: int) -> list[Path]:
    """One factory config a shard: its libraries (round-robin) from the carried sdists, its own out dir."""
    raw = tomllib.loads(Path(config).read_text())
    record = json.loads((src / "libraries.json").read_text())
    sdist = {x["spec"]: str((src / "sdists" / x["sdist"]).resolve()) for x in record["libraries"]}
    missing = [lib["spec"] for lib in raw["libraries"] if lib["spec"] not in sdist]
    if missing:
        raise ConfigError(f"{src / 'libraries.json'}: no sdist prepared for {missing} (run `prepare` with {config})")
    paths = []
    for i in range(shards):
        libs = [dict(lib, spec=sdist[lib["spec"]]) for lib in raw["libraries"][i::shards]]
        if not libs:
            continue
        part = dict(raw, factory=dict(raw.get("factory", {}), out=str(out / f"shard-{i}"), workers=workers),
                    libraries=libs)
        p = out / f"shard-{i}.toml"
        p.write_text(tomli_w.dumps(part))
        paths.append(p)
    return paths


def run(config: Path, src: Path, out: Path, shards: int, workers: int, deadline_s: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str((src / "wheels").resolve()),
               PIP_DISABLE_PIP_VERSION_CHECK="1", OPENCOMPOSER_PYPI_URL="http://offline.invalid/pypi")
    procs = []
    for p in shard_configs(config, src, out, shards, workers):
        log = open(out / f"{p.stem}.log", "a")
        procs.append((p, subprocess.Popen([sys.executable, "-m", "opencomposer.cli", "tasks", "make", "--config", str(p)],
                                          stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)))
    t0 = time.time()
    while any(pr.poll() is None for _, pr in procs) and time.time() - t0 < deadline_s:
        time.sleep(2)
    stopped = [p.stem for p, pr in procs if pr.poll() is None]
    for _, pr in procs:
        if pr.poll() is None:
            os.killpg(pr.pid, signal.SIGTERM)
    for _, pr in procs:
        try:
            pr.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(pr.pid, signal.SIGKILL)
            pr.wait()
    made = {p.stem: sum(1 for d in (out / p.stem).iterdir() if (d / "task.toml").is_file())
            if (out / p.stem).is_dir() else 0 for p, _ in procs}
    return {"run": str(out), "shards": len(procs), "made": made, "tasks": sum(made.values()),
            "stopped_before_done": stopped, "done": not stopped, "seconds": round(time.time() - t0, 1)}


def merge(out: Path) -> dict:
    """Every shard's task dirs and environments into ``out`` (task dirs name their env as
    ``../_envs/NAME``, so they hold); a shard's journal and summary stay in its folder."""
    moved = 0
    for shard in sorted(out.glob("shard-*")):
        if not shard.is_dir():
            continue
        for env in sorted((shard / ENVS).iterdir()) if (shard / ENVS).is_dir() else []:
            if not env.name.startswith("."):
                (out / ENVS).mkdir(exist_ok=True)
                if (out / ENVS / env.name).exists():
                    raise ConfigError(f"{env}: {out / ENVS / env.name} exists already (two shards made one library?)")
                env.rename(out / ENVS / env.name)
        for task in sorted(shard.iterdir()):
            if (task / "task.toml").is_file():
                task.rename(out / task.name)
                moved += 1
    return {"merged": str(out), "tasks": moved, "total": sum(1 for d in out.iterdir() if (d / "task.toml").is_file())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("config", type=Path)
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--python-version", default="3.12", help="the target machine's Python X.Y ('' = this one's)")
    p.add_argument("--platform", action="append", default=None)
    r = sub.add_parser("run")
    r.add_argument("config", type=Path)
    r.add_argument("--dir", type=Path, required=True, help="what `prepare` made (sdists/, wheels/, libraries.json)")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--shards", type=int, default=4)
    r.add_argument("--workers", type=int, default=4)
    r.add_argument("--deadline-s", type=float, default=500)
    m = sub.add_parser("merge")
    m.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "prepare":
            res = prepare(a.config, a.dest, a.python_version or None, a.platform or PLATFORMS)
        elif a.cmd == "run":
            res = run(a.config, a.dir, a.out, a.shards, a.workers, a.deadline_s)
        else:
            res = merge(a.out)
    except ConfigError as e:
        print(json.dumps({"error": str(e)}))
        return 2
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
