"""Leakage: the probe finds a deleted line planted in each channel (source copy, .pyc bytecode,
git history, wheel/zip/sdist), and finds nothing once the workspace is scrubbed and given a
fresh git repo."""

from __future__ import annotations

import importlib.util
import py_compile
import subprocess
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from opencomposer.tasks.deletion import delete, find_candidates
from opencomposer.tasks.deletion import make_patch
from opencomposer.tasks.leakage import (
    distinctive_lines,
    fresh_git,
    gold_windows,
    probe,
    scrub_workspace,
)

ORIGINAL = '''\
from itertools import islice


def chunked(iterable, n):
    """Break iterable into lists of length n.

    >>> list(chunked([1, 2, 3], 2))
    """
    iterator = iter(iterable)
    while True:
        chunk = list(islice(iterator, n))
        if not chunk:
            return
        yield chunk


def pairs(iterable):
    return chunked(iterable, 2)
'''
PLANTED = "chunk = list(islice(iterator, n))"


def _git(ws: Path, *args: str) -> None:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}
    subprocess.run(["git", "-C", str(ws), *args], check=True, capture_output=True, env=env)


@pytest.fixture
def task(tmp_path: Path):
    """A workspace whose pkg/mod.py had `chunked`'s body deleted, and the probe lines."""
    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg/mod.py").write_text(ORIGINAL)
    (ws / "pkg/__init__.py").write_text("")
    cand = next(c for c in find_candidates(ws, ["pkg"]) if c.name == "chunked")
    d = delete(ORIGINAL, cand, "body")
    (ws / "pkg/mod.py").write_text(d.after)
    lines = distinctive_lines(d.removed, remaining=ws)
    return ws, d, lines


def test_distinctive_lines(task) -> None:
    ws, d, lines = task
    # `while True:` and `return` are too plain to prove anything; the docstring is not probed
    assert lines == ["iterator = iter(iterable)", PLANTED, "if not chunk:"]
    whole = distinctive_lines(ORIGINAL, min_len=8)
    assert "def chunked(iterable, n):" in whole
    assert not any("Break iterable" in s or ">>>" in s for s in whole)  # docstring stays: no probe
    assert distinctive_lines(ORIGINAL, min_len=8, remaining=[d.after]) == lines  # def line kept
    # more than max_lines: longest code lines win, original order kept
    body = "\n".join(f"    value_{i} = compute({'x' * i})  # {i}" for i in range(30))
    picked = distinctive_lines(body, max_lines=5)
    assert [int(s.rsplit("# ", 1)[1]) for s in picked] == [25, 26, 27, 28, 29]


def test_clean_workspace_has_no_hits(task) -> None:
    ws, _, lines = task
    result = probe([ws], lines)
    assert result.clean, result.summary()
    assert result.checked["source"] == 2 and result.n_lines == 3


def test_finds_source_copy_and_reports_line(task, tmp_path: Path) -> None:
    ws, _, lines = task
    (ws / "notes").mkdir()
    (ws / "notes/old_mod.txt").write_text("x\n" + ORIGINAL)
    hits = probe([ws], lines).hits
    assert {(h.path, h.line, h.kind) for h in hits} == {
        (str(ws / "notes/old_mod.txt"), n, "source") for n in (10, 12, 13)}


def test_finds_compiled_copy_by_bytecode(task, tmp_path: Path) -> None:
    ws, _, lines = task
    orig = tmp_path / "orig/mod.py"
    orig.parent.mkdir()
    orig.write_text(ORIGINAL)
    pyc = Path(importlib.util.cache_from_source(str(ws / "pkg/mod.py")))
    py_compile.compile(str(orig), cfile=str(pyc), doraise=True)
    result = probe([ws], lines)
    assert result.checked["compiled"] == 1
    assert {(h.path, h.line, h.kind, h.text) for h in result.hits} == {
        (str(pyc), 11, "compiled", PLANTED), (str(pyc), 9, "compiled", "iterator = iter(iterable)")}
    # `if not chunk:` compiles to too little (one name) to be told apart in bytecode
    # the deleted module's own bytecode is no leak
    py_compile.compile(str(ws / "pkg/mod.py"), cfile=str(pyc), doraise=True)
    assert probe([ws], lines).clean
    # bytecode of another Python version: counted, searched as raw bytes only
    pyc.write_bytes(b"\x00\x00\r\n" + pyc.read_bytes()[4:])
    assert probe([ws], lines).checked["compiled_other_python"] == 1


def test_finds_git_history(task) -> None:
    ws, d, lines = task
    (ws / "pkg/mod.py").write_text(ORIGINAL)
    _git(ws, "init", "-q")
    _git(ws, "add", "-A")
    _git(ws, "commit", "-q", "-m", "original")
    (ws / "pkg/mod.py").write_text(d.after)
    _git(ws, "commit", "-q", "-am", "delete")
    result = probe([ws], lines)
    assert result.checked["git_objects"] >= 6
    assert {h.kind for h in result.hits} == {"git"} and {h.text for h in result.hits} == set(lines)
    assert all(h.path.startswith(f"{ws}/.git@") for h in result.hits)


def test_finds_archives(task, tmp_path: Path) -> None:
    ws, _, lines = task
    with zipfile.ZipFile(ws / "dist_copy.whl", "w") as z:
        z.writestr("pkg/mod.py", ORIGINAL)
    orig = tmp_path / "mod.py"
    orig.write_text(ORIGINAL)
    pyc = tmp_path / "mod.pyc"
    py_compile.compile(str(orig), cfile=str(pyc), doraise=True)
    with zipfile.ZipFile(ws / "bundle.zip", "w") as z:
        z.write(pyc, "pkg/__pycache__/mod.cpython-311.pyc")
    with tarfile.open(ws / "pkg-1.0.tar.gz", "w:gz") as t:
        t.add(orig, "pkg-1.0/pkg/mod.py")
    result = probe([ws], lines)
    assert result.checked["archives"] == 3 and result.checked["archive_members"] == 2
    found = {(h.path.removeprefix(f"{ws}/"), h.kind, h.text) for h in result.hits}
    assert found == {(f"{a}!{m}", "archive", s) for a, m in [
        ("dist_copy.whl", "pkg/mod.py"), ("bundle.zip", "pkg/__pycache__/mod.cpython-311.pyc"),
        ("pkg-1.0.tar.gz", "pkg-1.0/pkg/mod.py")] for s in lines
        if not (a == "bundle.zip" and s == "if not chunk:")}  # too little bytecode to match
    assert set(result.suspects()) == {h.path for h in result.hits}


def test_scrub_then_fresh_git_is_clean(task, tmp_path: Path) -> None:
    ws, d, lines = task
    (ws / "pkg/mod.py").write_text(ORIGINAL)
    _git(ws, "init", "-q")
    _git(ws, "add", "-A")
    _git(ws, "commit", "-q", "-m", "original")
    (ws / "pkg/mod.py").write_text(d.after)
    py_compile.compile(str(ws / "pkg/mod.py"), cfile=str(ws / "pkg/mod.pyc"))
    junk = ["build/lib/pkg/mod.py", "dist/pkg-1.0.tar.gz", "src/pkg.egg-info/SOURCES.txt",
            ".pytest_cache/v", ".mypy_cache/x", ".ruff_cache/x", ".tox/py/x", ".nox/x",
            ".eggs/x", ".hypothesis/x", "htmlcov/index.html", "pkg/__pycache__/m.pyc",
            ".coverage", ".coverage.host.1", "pkg/mod.py.orig", "pkg/mod.py.rej", "pkg/old.pyo"]
    for rel in junk:
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(ORIGINAL)
    (ws / "pkg/build").mkdir()  # a subpackage called build is source, not a build tree
    (ws / "pkg/build/__init__.py").write_text("")
    assert not probe([ws], lines).clean
    removed = scrub_workspace(ws)
    assert ".git/" in removed and "build/" in removed and "src/pkg.egg-info/" in removed
    assert "pkg/mod.pyc" in removed and ".coverage.host.1" in removed
    assert (ws / "pkg/build/__init__.py").exists() and (ws / "pkg/mod.py").exists()
    sha = fresh_git(ws)
    result = probe([ws], lines)
    assert result.clean, result.summary()
    assert result.checked["git_objects"] >= 4
    with pytest.raises(FileExistsError):
        fresh_git(ws)
    # same files, same commit: tasks rebuild reproducibly
    twin = tmp_path / "twin"
    subprocess.run(["cp", "-r", str(ws), str(twin)], check=True)
    subprocess.run(["rm", "-rf", str(twin / ".git")], check=True)
    assert fresh_git(twin) == sha


def test_probe_5k_files_is_fast(tmp_path: Path) -> None:
    root = tmp_path / "big"
    for i in range(5000):
        d = root / f"d{i % 50}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 40)
    (root / "d7/m7.py").write_text("    " + PLANTED + "\n")
    start = time.perf_counter()
    result = probe([root], [PLANTED, "iterator = iter(iterable)"])
    assert time.perf_counter() - start < 10
    assert result.checked["source"] == 5000
    assert [(h.path, h.line) for h in result.hits] == [(str(root / "d7/m7.py"), 1)]


def test_a_deleted_line_also_in_a_non_python_file_of_the_workspace_is_not_distinctive(tmp_path):
    """The probe searches every file, so lines the workspace holds anyway (a script, docs) prove nothing."""
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "make-data").write_text("#!/usr/bin/env python3\nparser.add_argument('--out')\n")
    (tmp_path / "blob.bin").write_bytes(b"\0\1parser.add_argument(")
    removed = "    parser = make_parser()\n    parser.add_argument('--out')\n    return parser.parse_args(argv)\n"
    lines = distinctive_lines(removed, remaining=tmp_path)
    assert "parser.add_argument('--out')" not in lines and "return parser.parse_args(argv)" in lines


def test_a_one_line_deletion_is_found_in_a_copy_by_its_context(tmp_path: Path) -> None:
    """`return chunked(iterable, 2)`'s loss has no distinctive line (too plain), but a copy of the
    original holds it between the lines around it: the window probe finds that copy, in a plain
    file and inside an archive, and never in the workspace that lacks it."""
    after = ORIGINAL.replace("    return chunked(iterable, 2)\n", "")
    patch = make_patch(ORIGINAL, after, "pkg/mod.py")
    windows = gold_windows(patch)
    assert windows == [("", "def pairs(iterable):", "return chunked(iterable, 2)")]
    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg/mod.py").write_text(after)
    (ws / "pkg/other.py").write_text("def g(iterable):\n    return chunked(iterable, 2)\n")  # the line alone: no copy
    assert probe([ws], [], windows).window_hits == []
    (ws / "vendor").mkdir()
    (ws / "vendor/mod_copy.py").write_text("# kept\n" + ORIGINAL.replace("    ", "\t"))  # other indentation too
    with zipfile.ZipFile(ws / "vendor/old.zip", "w") as z:
        z.writestr("pkg/mod.py", ORIGINAL)
    hits = probe([ws], [], windows).window_hits
    # each hit at the window's first line (the blank line before `def pairs`)
    assert {(h.path, h.line) for h in hits} == {(str(ws / "vendor/mod_copy.py"), 17),
                                                (str(ws / "vendor/old.zip") + "!pkg/mod.py", 16)}
    # a body replaced by a stub: the removed stub line is not part of the original's window
    body = ORIGINAL.replace("    return chunked(iterable, 2)\n", "    raise NotImplementedError\n")
    assert gold_windows(make_patch(ORIGINAL, body, "pkg/mod.py")) == windows
