"""``tasks pack`` / ``tasks unpack``: real tasks through a pack and back, envs rebuilt offline,
and every kind of damaged or hostile pack refused, naming the file or part."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
import zstandard
from testkit.dists import make_wheel
from typer.testing import CliRunner

from opencomposer.cli import app
from opencomposer.config import ConfigError
from opencomposer.episode.oracle import run_oracle
from opencomposer.grading.check import check_task
from opencomposer.tasks.envs import EnvError
from opencomposer.tasks.format import ENVS, Task, TaskMeta, task_dirs, write_task_toml
from opencomposer.tasks.pack import pack_tasks, split_wheels, unpack_tasks
from opencomposer.tasks import packenv
from opencomposer.tasks.packenv import installed
from opencomposer.tasks.packparts import PackError, PartsReader, PartsWriter, find_parts
from opencomposer.tasks.sources.humaneval import import_humaneval

TEST_DISTS = ("pytest", "pluggy", "iniconfig", "packaging", "pygments")


def pytest_env(dest: Path) -> Path:
    """A small venv holding this interpreter's pytest (linked in, nothing downloaded): the env an
    operator links into ``_envs/`` on the GPU machine (this interpreter's whole env is slow to leak-scan)."""
    import importlib.metadata

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    site = next((dest / "lib").glob("python3*/site-packages"))
    for name in TEST_DISTS:
        dist = importlib.metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = Path(dist.locate_file(top))
            if src.exists() and not (site / top).exists() and top != "__pycache__":
                os.symlink(src, site / top)
    return dest


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` but ``_envs``: file -> (sha256, mode), link -> target, dir -> mode."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ENVS]
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_file():
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mode & 0o777)
            else:
                out[rel] = ("dir", p.stat().st_mode & 0o777)
    return out


def clone_task(src: Path, dest: Path, new_id: str, env: str | None = None) -> None:
    shutil.copytree(src, dest, symlinks=True)
    data = tomllib.loads((dest / "task.toml").read_text())
    data["id"] = new_id
    if env is not None:
        data["environment"]["env"] = env
    write_task_toml(dest / "task.toml", TaskMeta.model_validate(data))


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path, object]:
    """Real HumanEval tasks (two, plus a copy of one under another id: shared files), an
    executable file and a symlink; packed without wheels (their env is this interpreter's)."""
    root = tmp_path_factory.mktemp("pack")
    src = root / "tasks"
    rep = import_humaneval(src, [0, 2], env=pytest_env(root / "pytest-env"))
    assert rep.ok == ["HumanEval_0", "HumanEval_2"]
    clone_task(src / "HumanEval_0", src / "HumanEval_0b", "HumanEval_0b")
    run = src / "HumanEval_2" / "workspace" / "run.sh"
    run.write_text("#!/bin/sh\necho hi\n")
    run.chmod(0o755)
    os.symlink("solution.py", src / "HumanEval_2" / "workspace" / "alias.py")
    report = pack_tasks(src, root / "he.ocpack", wheels=False)
    return src, root / "he.ocpack", report, root / "pytest-env"


def test_round_trip_keeps_files_modes_and_links_and_stores_shared_files_once(packed, tmp_path):
    src, pack, report, _ = packed
    assert report.tasks == 3 and report.objects < report.files  # the copy's files are stored once
    assert report.bytes_out < report.bytes_in
    rep = unpack_tasks(pack, tmp_path / "out", envs=False)
    assert rep.tasks == 3 and rep.envs == []
    assert tree(tmp_path / "out") == tree(src)
    assert tree(tmp_path / "out")["HumanEval_2/workspace/run.sh"][2] == 0o755
    assert not (tmp_path / "out" / ENVS).exists()  # --no-envs: files only, an env is the operator's to link
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging dir left behind


def test_unpacked_task_loads_checks_and_the_oracle_solves_it(packed, tmp_path):
    src, pack, _, env = packed
    out = tmp_path / "out"
    unpack_tasks(pack, out, envs=False)
    env_name = Path(Task.load(src / "HumanEval_0").meta.environment.env).name
    (out / ENVS).mkdir()
    os.symlink(env, out / ENVS / env_name)  # what tasks.envs.adopt_env does on the GPU machine
    tasks = [Task.load(d) for d in task_dirs(out)]
    assert [t.id for t in tasks] == ["HumanEval_0", "HumanEval_0b", "HumanEval_2"]
    res = check_task(out / "HumanEval_0", "local")
    assert res.ok, res.problems
    rows = run_oracle([tasks[0]], "local", workers=1)
    assert rows[0]["reward"] == 1.0, rows


def test_a_pack_without_wheels_will_not_pretend_to_rebuild_its_env(packed, tmp_path):
    with pytest.raises(PackError, match="packed without wheels.*--no-envs"):
        unpack_tasks(packed[1], tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def tiny(packed, tmp_path_factory) -> tuple[Path, Path]:
    """A task whose env (``_envs/tiny``) holds one pure-python distribution, and the wheelhouse of it."""
    root = tmp_path_factory.mktemp("tiny")
    src = root / "tasks"
    wheels = make_wheel(root / "wheelhouse").parent
    env = src / ENVS / "tiny"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "-q",
                    "--no-index", f"--find-links={wheels}", "tinydep"], check=True)
    (env / "env.json").write_text(json.dumps({"requirements": ["tinydep"]}))
    clone_task(packed[0] / "HumanEval_2", src / "HumanEval_2", "HumanEval_2", env="../_envs/tiny")
    return src, wheels


def test_env_is_rebuilt_from_carried_wheels_with_the_index_disabled(tiny, tmp_path, monkeypatch):
    src, wheels = tiny
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pack and unpack alike: the network is never asked
    rep = pack_tasks(src, tmp_path / "t.ocpack", find_links=[wheels])
    assert rep.envs == {"tiny": {"python": "%d.%d" % sys.version_info[:2], "installed": 1, "wheels": 1}}
    out = tmp_path / "out"
    got = unpack_tasks(tmp_path / "t.ocpack", out)
    assert got.envs == ["tiny"]
    env = out / ENVS / "tiny"
    assert installed(env) == ["tinydep==0.1"]
    r = subprocess.run([str(env / "bin" / "python"), "-c", "import tinydep; print(tinydep.VALUE)"],
                       capture_output=True, text=True)
    assert r.stdout.strip() == "42", r.stderr
    assert json.loads((env / "env.json").read_text()) == {"requirements": ["tinydep"]}
    task = Task.load(out / "HumanEval_2")  # its relative env path still holds
    assert task.env_dir == env.resolve()
    assert not (out / ".wheels").exists() and not (out / ".objects").exists()


def test_a_pack_without_wheels_is_rebuilt_from_fetched_wheels(tiny, tmp_path, monkeypatch):
    """The compact pack kept in git (--no-wheels) becomes a working task set where wheels can be had:
    the same pinned distributions, fetched, then the same offline rebuild."""
    src, wheels = tiny
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    pack_tasks(src, tmp_path / "t.ocpack", wheels=False)
    with pytest.raises(EnvError, match=r"env tiny: fetching its pinned wheels.*tinydep==0.1"):
        unpack_tasks(tmp_path / "t.ocpack", tmp_path / "bad", fetch_wheels=True, find_links=[tmp_path / "empty"])
    assert not (tmp_path / "bad").exists()
    out = tmp_path / "out"
    got = unpack_tasks(tmp_path / "t.ocpack", out, fetch_wheels=True, find_links=[wheels])
    assert got.envs == ["tiny"]
    assert installed(out / ENVS / "tiny") == ["tinydep==0.1"]
    assert Task.load(out / "HumanEval_2").env_dir == (out / ENVS / "tiny").resolve()
    assert not (out / ".wheels").exists()
    # made for another Python (a set from the GPU machine's 3.12): the same pins, fetched for this one
    assert got.retargeted == {}  # made with this Python
    with monkeypatch.context() as m:  # an env made with another Python, as the GPU machine's 3.12 ones
        m.setattr(packenv, "env_python", lambda env: "3.99")
        pack_tasks(src, tmp_path / "other.ocpack", wheels=False, python_version="3.99")
    other = unpack_tasks(tmp_path / "other.ocpack", tmp_path / "other", fetch_wheels=True, find_links=[wheels])
    assert installed(tmp_path / "other" / ENVS / "tiny") == ["tinydep==0.1"]
    here = "%d.%d" % sys.version_info[:2]  # named, since its tasks were validated on 3.99, not here
    assert other.retargeted == {"tiny": f"made with Python 3.99, rebuilt for {here}"}


def test_packs_split_into_wheel_less_packs_and_one_wheelhouse_rebuild_the_same_envs(tiny, tmp_path, monkeypatch):
    """Task sets whose libraries share wheels carry them once (session 43: four sets' 340 MB of packs held
    190 MB of distinct wheels): each pack written again without its wheels, the wheels into one wheelhouse."""
    src, wheels = tiny
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    pack_tasks(src, tmp_path / "a.ocpack", find_links=[wheels])
    pack_tasks(src, tmp_path / "b.ocpack", find_links=[wheels], part_size=4000)  # another set, in parts
    house = tmp_path / "house"
    r = CliRunner().invoke(app, ["tasks", "split-wheels", str(tmp_path / "a.ocpack"), "-o", str(tmp_path / "a2.ocpack"),
                                 "--wheelhouse", str(house)])
    assert r.exit_code == 0, r.output
    first = json.loads(r.stdout.strip().splitlines()[-1])
    assert first["wheels"] == 1 and first["added"] == 1 and first["bytes_out"] < first["bytes_in"]
    b = split_wheels(tmp_path / "b.ocpack", tmp_path / "b2.ocpack", house)
    assert (b.wheels, b.added) == (1, 0)  # the same wheel, already there: carried once
    assert [w.name for w in house.iterdir()] == ["tinydep-0.1-py3-none-any.whl"]
    with pytest.raises(PackError, match="packed without wheels"):
        unpack_tasks(tmp_path / "a2.ocpack", tmp_path / "x")
    def no_download(*a, **k):
        raise AssertionError("every pin's wheel is in the wheelhouse: nothing to download")

    monkeypatch.setattr(packenv, "fetch_wheels", no_download)  # installed straight from the wheelhouse
    for name in ("a2", "b2"):
        out = tmp_path / f"out-{name}"
        got = unpack_tasks(tmp_path / f"{name}.ocpack", out, fetch_wheels=True, find_links=[house])
        assert got.envs == ["tiny"] and installed(out / ENVS / "tiny") == ["tinydep==0.1"]
        assert tree(out) == tree(src)
    # another build of a wheel already in the wheelhouse under its name is refused, naming both checksums
    (house / "tinydep-0.1-py3-none-any.whl").write_bytes(b"another build")
    with pytest.raises(PackError, match=r"house/tinydep-0.1-py3-none-any.whl: sha256 \w+, but .*a.ocpack carries "
                                        r"tinydep-0.1-py3-none-any.whl with sha256 \w+"):
        split_wheels(tmp_path / "a.ocpack", tmp_path / "a3.ocpack", house)
    assert not list(tmp_path.glob("a3.ocpack*"))


def test_env_is_rebuilt_even_when_pythonpath_already_shows_its_packages(tiny, tmp_path, monkeypatch):
    """On the GPU machine PYTHONPATH held the same pytest as the env's wheels: pip saw it as installed
    and put nothing in the env. The rebuild must ignore what lies outside the env."""
    src, wheels = tiny
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    pack_tasks(src, tmp_path / "t.ocpack", find_links=[wheels])
    shadow = tmp_path / "shadow"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", f"--find-links={wheels}",
                    "--target", str(shadow), "tinydep"], check=True)
    monkeypatch.setenv("PYTHONPATH", str(shadow))
    out = tmp_path / "out"
    unpack_tasks(tmp_path / "t.ocpack", out)
    assert installed(out / ENVS / "tiny") == ["tinydep==0.1"]


def test_a_wheel_that_cannot_be_had_names_the_environment_and_how_to_pack_without_it(tiny, tmp_path, monkeypatch):
    src, _ = tiny
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    empty = tmp_path / "empty-wheelhouse"
    empty.mkdir()
    with pytest.raises(EnvError, match=r"(?s)_envs/tiny \(the environment of 1 task\(s\) of [^)]+\): tinydep==0\.1: no wheel "
                                       r".*; pack without it: --exclude-library \S+$"):
        pack_tasks(src, tmp_path / "t.ocpack", find_links=[empty])
    assert not list(tmp_path.glob("t.ocpack*"))  # nothing half-made


def test_env_packed_for_another_python_is_refused_naming_both_versions(tiny, tmp_path, monkeypatch):
    src, wheels = tiny
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    pack_tasks(src, tmp_path / "t.ocpack", find_links=[wheels], python_version="3.99")
    with pytest.raises(EnvError, match=r"needs Python 3\.99.*is %d\.%d" % sys.version_info[:2]):
        unpack_tasks(tmp_path / "t.ocpack", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-made


def test_parts_round_trip_and_a_missing_or_damaged_part_is_named(packed, tmp_path):
    src, _, _, _ = packed
    r = CliRunner().invoke(app, ["tasks", "pack", str(src), "-o", str(tmp_path / "p.ocpack"), "--part-size",
                                 "2K", "--no-wheels"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    parts = [Path(p) for p in res["parts"]]
    assert len(parts) >= 3 and parts[0].name == "p.ocpack.part-000"
    assert all(p.stat().st_size <= 2 * 1024 for p in parts)
    assert not (tmp_path / "p.ocpack").exists()
    r = CliRunner().invoke(app, ["tasks", "unpack", str(parts[0]), "-o", str(tmp_path / "a"), "--no-envs"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["tasks"] == 3
    unpack_tasks(tmp_path / "p.ocpack", tmp_path / "b", envs=False)  # the base name works too
    assert tree(tmp_path / "a") == tree(tmp_path / "b") == tree(src)

    damaged = bytearray(parts[1].read_bytes())
    damaged[-10] ^= 0xFF
    saved = parts[1].read_bytes()
    parts[1].write_bytes(damaged)
    with pytest.raises(PackError, match=r"p\.ocpack\.part-001: damaged"):
        unpack_tasks(parts[0], tmp_path / "c", envs=False)
    parts[1].write_bytes(saved)
    parts[1].unlink()
    with pytest.raises(PackError, match=r"p\.ocpack\.part-001: missing"):
        unpack_tasks(parts[0], tmp_path / "c", envs=False)
    r = CliRunner().invoke(app, ["tasks", "unpack", str(parts[0]), "-o", str(tmp_path / "c"), "--no-envs"])
    assert r.exit_code == 2 and "part-001: missing" in json.loads(r.stdout.strip().splitlines()[-1])["error"]
    assert not (tmp_path / "c").exists()


def rewrite(pack: Path, out: Path, edit) -> Path:
    """The pack's members passed through ``edit(name, data) -> [(name, data), ...]`` and written as a
    pack whose parts are intact: only the per-file checks can catch what ``edit`` did."""
    raw = zstandard.ZstdDecompressor().stream_reader(PartsReader(find_parts(pack)), read_across_frames=True)
    tar = tarfile.open(fileobj=raw, mode="r|")
    members = []
    while (m := tar.next()) is not None:
        members += edit(m.name, tar.extractfile(m).read())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    w = PartsWriter(out, None, "tampered")
    w.write(zstandard.ZstdCompressor().compress(buf.getvalue()))
    w.finish()
    return out


def manifest_edit(change):
    def edit(name, data):
        if name != "manifest.json":
            return [(name, data)]
        m = json.loads(data)
        change(m)
        return [(name, json.dumps(m).encode())]
    return edit


def sha_of(src: Path, rel: str) -> str:
    return hashlib.sha256((src / rel).read_bytes()).hexdigest()


def test_altered_missing_or_extra_file_is_refused_naming_it(packed, tmp_path):
    src, pack, _, _ = packed
    target = sha_of(src, "HumanEval_2/instruction.md")  # used by one file only

    def alter(name, data):
        return [(name, data + b"# sneaked in\n" if name == f"objects/{target}" else data)]

    with pytest.raises(PackError, match=r"HumanEval_2/instruction\.md: altered or damaged.*expected \d+ bytes with sha256 " + target):
        unpack_tasks(rewrite(pack, tmp_path / "altered", alter), tmp_path / "o1", envs=False)
    with pytest.raises(PackError, match=r"HumanEval_2/instruction\.md: missing from the pack"):
        unpack_tasks(rewrite(pack, tmp_path / "missing", lambda n, d: [] if n == f"objects/{target}" else [(n, d)]),
                     tmp_path / "o2", envs=False)
    extra = lambda n, d: [(n, d)] + ([("HumanEval_0/workspace/evil.py", b"x")] if n == "manifest.json" else [])
    with pytest.raises(PackError, match=r"member 'HumanEval_0/workspace/evil\.py' is not a file listed"):
        unpack_tasks(rewrite(pack, tmp_path / "extra", extra), tmp_path / "o3", envs=False)
    assert not any(tmp_path.glob("o*"))  # refused before anything was written


@pytest.mark.parametrize("bad", ["../evil.py", "HumanEval_0/../../evil.py", "/etc/evil.py", "elsewhere/evil.py"])
def test_a_path_leaving_dir_is_refused_naming_it(packed, tmp_path, bad):
    pack = packed[1]

    def add(m):
        m["files"].append({**m["files"][0], "path": bad})

    with pytest.raises(PackError, match=f"file {bad!r}: refused"):
        unpack_tasks(rewrite(pack, tmp_path / "bad", manifest_edit(add)), tmp_path / "out", envs=False)
    assert not (tmp_path / "out").exists() and not (tmp_path.parent / "evil.py").exists()


def test_a_symlink_out_of_its_task_is_refused(packed, tmp_path):
    def add(m):
        m["links"].append({"path": "HumanEval_0/workspace/up", "target": "../../HumanEval_2"})

    with pytest.raises(PackError, match=r"symlink 'HumanEval_0/workspace/up' -> '\.\./\.\./HumanEval_2': refused"):
        unpack_tasks(rewrite(packed[1], tmp_path / "bad", manifest_edit(add)), tmp_path / "out", envs=False)


def test_unpack_refuses_a_non_empty_dir_naming_it(packed, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine\n")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'out'}: exists and is not empty"):
        unpack_tasks(packed[1], tmp_path / "out", envs=False)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    assert unpack_tasks(packed[1], tmp_path / "empty", envs=False).tasks == 3  # an empty dir is fine


def test_a_pack_of_some_libraries_only(packed, tmp_path):
    """--library / --exclude-library pick tasks by the library their spec names (pip's spelling rules);
    a name with no task is refused, listing the libraries there are."""
    src = tmp_path / "tasks"
    shutil.copytree(packed[0], src, symlinks=True)
    clone_task(src / "HumanEval_2", src / "mini_1", "mini_1")
    data = tomllib.loads((src / "mini_1" / "task.toml").read_text())
    data["source"]["spec"] = "Mini_Lib==1.0"
    write_task_toml(src / "mini_1" / "task.toml", TaskMeta.model_validate(data))
    only = pack_tasks(src, tmp_path / "only.ocpack", wheels=False, libraries=["mini-lib"])
    assert only.tasks == 1
    rest = pack_tasks(src, tmp_path / "rest.ocpack", wheels=False, exclude_libraries=["MINI.LIB"])
    assert rest.tasks == 3
    out = tmp_path / "unpacked"
    unpack_tasks(tmp_path / "only.ocpack", out, envs=False)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("_")) == ["mini_1"]
    with pytest.raises(ConfigError, match=r"--library nope: no task of that library in .*its libraries: 0, 2, mini-lib"):
        pack_tasks(src, tmp_path / "x.ocpack", wheels=False, libraries=["nope"])
