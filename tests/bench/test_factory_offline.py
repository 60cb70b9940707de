"""benchmarks/factory_offline.py: the factory made ready here (sdists + the wheels its install recipe used, its
repairs included) and then run with pip held to those wheels (no index), in shards at once, resumed, merged into
one task set whose tasks check. A tiny real sdist stands for a library: its suite needs a module that only the
recipe's repair round finds, so a wheelhouse of the discovered requirements alone would not do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from testkit.dists import make_sdist

from opencomposer.grading.check import check_task
from opencomposer.tasks.format import find_tasks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "factory_offline.py"

CORE = '''\
def double(x):
    """Twice x, as a string in brackets."""
    y = x * 2
    text = str(y)
    return "[" + text + "]"


def shout(text):
    """Upper case with a bang."""
    t = text.upper()
    t = t.strip()
    return t + "!"
'''

TESTS = '''\
import six  # noqa: F401  (a module no requirement names: the recipe's repair round adds it)
from {name}.core import double, shout


def test_double():
    assert double(2) == "[4]"


def test_shout():
    assert shout(" a ") == "A!"
'''


def _sdist(tmp: Path, name: str) -> Path:
    return make_sdist(tmp, name, {f"{name}/__init__.py": "", f"{name}/core.py": CORE,
                                  "tests/test_core.py": TESTS.format(name=name)})


def _run(*args: str) -> dict:
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # builds small venvs from PyPI here, then offline from the wheels fetched
def test_prepared_factory_runs_offline_in_shards_and_merges(tmp_path: Path) -> None:
    libs = [_sdist(tmp_path, "alib"), _sdist(tmp_path, "blib")]
    cfg = tmp_path / "cfg.toml"
    cfg.write_text('[factory]\nout = "unused"\nmax_per_library = 2\nseed = 0\nbackend = "local"\nworkers = 1\n'
                   'test_timeout = 120.0\n\n[difficulty]\nposition = 0.0\nwidth = 0.5\nfloor = 0.0\n\n'
                   + "".join(f'[[libraries]]\nspec = "{p}"\n' for p in libs))
    prep = tmp_path / "prep"
    got = _run("prepare", str(cfg), "--dest", str(prep), "--python-version", "")
    assert got["libraries"] == 2 and got["missing"] == {}, got
    record = json.loads((prep / "libraries.json").read_text())
    for lib in record["libraries"]:  # the repair round's module is among what the recipe ended up installing
        assert lib["install_here"] == "repair" and any(p.startswith("six==") for p in lib["installed_here"]), lib
    assert any(w.name.startswith("six-") for w in (prep / "wheels").glob("*.whl"))
    out = tmp_path / "made"
    # a deadline too short for anything: the shards stop, nothing half-made is left, and the next call goes on
    first = _run("run", str(cfg), "--dir", str(prep), "--out", str(out), "--shards", "2", "--workers", "1",
                 "--deadline-s", "1")
    assert first["shards"] == 2 and not first["done"]
    done = _run("run", str(cfg), "--dir", str(prep), "--out", str(out), "--shards", "2", "--workers", "1",
                "--deadline-s", "600")
    assert done["done"] and done["made"]["shard-0"] >= 1 and done["made"]["shard-1"] >= 1, done
    for shard in ("shard-0", "shard-1"):  # each library's sdist came from the carried copy, pip never saw an index
        text = (out / f"{shard}.toml").read_text()
        assert str(prep / "sdists") in text
    merged = _run("merge", "--out", str(out))
    assert merged["total"] == done["tasks"]
    tasks = find_tasks([out])
    assert len(tasks) == done["tasks"] and {p.name.split("__")[0] for p in tasks} == {"alib-0.1", "blib-0.1"}
    for p in tasks:
        res = check_task(p, "local")
        assert res.ok, res.problems


def test_a_library_not_prepared_is_named(tmp_path: Path) -> None:
    prep = tmp_path / "prep"
    prep.mkdir()
    (prep / "libraries.json").write_text(json.dumps({"libraries": []}))
    cfg = tmp_path / "cfg.toml"
    cfg.write_text('[factory]\nout = "x"\n\n[[libraries]]\nspec = "toolz==1.2.0"\n')
    r = subprocess.run([sys.executable, str(SCRIPT), "run", str(cfg), "--dir", str(prep), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert "no sdist prepared for ['toolz==1.2.0']" in json.loads(r.stdout.strip().splitlines()[-1])["error"]
