"""Feature deletion on a small hand-made module and on real stdlib packages: which functions
are candidates, what each deletion leaves behind, and that the gold patch restores the
original byte for byte under GNU ``patch -p1``."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from opencomposer.tasks.deletion import (
    Candidate,
    Deletion,
    DeletionError,
    apply_deletion,
    definition_text,
    delete,
    delete_in_repo,
    find_candidates,
    make_patch,
    read_source,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
needs_patch = pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch not installed")

SAMPLE = '''\
"""A small module to delete things from."""
import functools
from abc import ABC, abstractmethod
from typing import overload


def helper(items, n):
    """Split items into chunks of n.

    More text.
    """
    # leading comment
    out = []
    for i in range(0, len(items), n):
        out.append(items[i : i + n])
    return out


def unused(x):
    y = x + 1
    z = y * 2
    return z


def short(x):
    return x


def uses_helper(items):
    return helper(items, 2) + Shape.Inner().only()


def one_liner(a): b = a; c = b; return c


def outer(x):
    def inner(y):
        a = y
        b = a
        return b
    total = inner(x)
    return total + 1


class Base(ABC):
    @abstractmethod
    def run(self):
        a = 1
        b = 2
        return a + b


class Shape:
    """A shape."""

    def __init__(self, w, h):
        self.w = w
        self.h = h
        self.area_cache = None

    @property
    def area(self):
        if self.area_cache is None:
            self.area_cache = self.w * self.h
        return self.area_cache

    @area.setter
    def area(self, value):
        self.area_cache = value
        self.w = value
        self.h = 1

    @functools.lru_cache(maxsize=None)
    def scaled(
        self,
        k,  # factor
    ):
        # comment before body
        w = self.w * k
        h = self.h * k
        return Shape(w, h)

    def __repr__(self):
        return f"Shape({self.w}, {self.h})"

    def __eq__(self, other):
        if not isinstance(other, Shape):
            return NotImplemented
        same_w = self.w == other.w
        same_h = self.h == other.h
        return same_w and same_h

    @overload
    def g(self, x):
        a = x
        b = a
        return b

    class Inner:
        def only(self):
            a = 1
            b = a + 1
            return b
            # trailing comment of Inner.only

    async def fetch(self):
        data = await self.load()
        data = data.strip()
        return data.scaled(2)
'''

EXPECTED = {  # qualname -> level offered
    "helper": "function",
    "unused": "body",
    "outer": "body",
    "Shape.area": "body",
    "Shape.scaled": "function",
    "Shape.__eq__": "body",
    "Shape.Inner.only": "function",
    "Shape.fetch": "body",
}


def _repo(tmp_path: Path, text: str = SAMPLE, name: str = "pkg/mod.py") -> Path:
    f = tmp_path / "repo" / name
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(text.encode())
    return tmp_path / "repo"


def _by_name(cands: list[Candidate]) -> dict[str, Candidate]:
    return {c.qualname: c for c in cands}


def _all_deletions(repo: Path, cands: list[Candidate]) -> list[Deletion]:
    out = []
    for c in cands:
        source = read_source(repo / c.file)
        out += [delete(source, c, level) for level in c.levels]
    return out


def _assert_patches_restore(tmp_path: Path, deletions: list[Deletion]) -> None:
    """Write every deleted file into its own dir and apply one combined gold patch with -p1."""
    work = tmp_path / "patched"
    patches = []
    for i, d in enumerate(deletions):
        f = work / str(i) / d.candidate.file
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(d.after.encode())
        patches.append(make_patch(d.before, d.after, f"{i}/{d.candidate.file}"))
    r = subprocess.run(["patch", "-p1", "-F0", "--batch", "--no-backup-if-mismatch", "-s"],
                       input="".join(patches).encode(), cwd=work, capture_output=True)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    for i, d in enumerate(deletions):
        assert (work / str(i) / d.candidate.file).read_bytes() == d.before.encode(), d.candidate.id


def test_candidates_on_sample(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    cands = find_candidates(repo, ["pkg"])
    assert {c.qualname: c.level for c in cands} == EXPECTED
    assert [c.qualname for c in cands] == list(EXPECTED)  # file order
    helper = _by_name(cands)["helper"]
    assert (helper.file, helper.name, helper.id) == ("pkg/mod.py", "helper", "pkg.mod--helper")
    assert helper.lineno == 7 and helper.has_docstring and helper.n_statements == 4
    assert helper.body_start_line == 12  # the leading comment goes with the body
    assert helper.end_lineno == 16 and helper.n_body_lines == 5
    scaled = _by_name(cands)["Shape.scaled"]
    assert scaled.decorator_lineno == scaled.lineno - 1
    assert helper.levels == ("line", "body", "function") and _by_name(cands)["unused"].levels == ("line", "body")
    assert helper.line == 13  # `out = []`: of the body's one-line statements, the one its name's checksum picks


def test_body_deletion_keeps_signature_and_docstring(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    c = _by_name(find_candidates(repo, ["pkg"]))["helper"]
    d = delete(SAMPLE, c, "body")
    assert d.removed.startswith("    # leading comment\n    out = []\n")
    assert '    More text.\n    """\n    raise NotImplementedError\n\n\ndef unused' in d.after
    assert "out.append" not in d.after and "leading comment" not in d.after
    assert apply_deletion(SAMPLE, c, "body") == d.after
    assert d.after.count("\n") == SAMPLE.count("\n") - 4
    # multi-line signature with a comment in it, decorator kept
    s = _by_name(find_candidates(repo, ["pkg"]))["Shape.scaled"]
    after = apply_deletion(SAMPLE, s, "body")
    assert "    @functools.lru_cache(maxsize=None)\n    def scaled(\n        self,\n" \
        "        k,  # factor\n    ):\n        raise NotImplementedError\n\n    def __repr__" in after


def test_function_deletion(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    cands = _by_name(find_candidates(repo, ["pkg"]))
    d = delete(SAMPLE, cands["helper"], "function")
    assert "def helper" not in d.after and "Split items" not in d.after
    assert '"""\nimport functools' in d.after  # module docstring and imports untouched
    assert "from typing import overload\n\n\ndef unused(x):" in d.after  # one gap, not two
    assert d.removed.lstrip("\n").startswith("def helper(items, n):")
    # a decorated method: decorator goes too
    after = apply_deletion(SAMPLE, cands["Shape.scaled"], "function")
    assert "lru_cache" not in after and "def scaled" not in after
    assert "        self.h = 1\n\n    def __repr__(self):" in after
    # the only method of a class: the class keeps a body
    after = apply_deletion(SAMPLE, cands["Shape.Inner.only"], "function")
    assert "    class Inner:\n        pass\n\n    async def fetch" in after
    assert "trailing comment of Inner.only" not in after


def test_refusals(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    cands = _by_name(find_candidates(repo, ["pkg"]))
    with pytest.raises(DeletionError, match="not allowed"):
        delete(SAMPLE, cands["unused"], "function")  # nobody calls it: nothing points at it
    with pytest.raises(DeletionError, match="not allowed"):
        delete(SAMPLE, cands["Shape.__eq__"], "function")
    with pytest.raises(DeletionError, match="definitions match"):
        delete(SAMPLE.replace("def unused", "def renamed"), cands["unused"], "body")


@needs_patch
def test_every_sample_deletion_parses_and_patch_restores(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    deletions = _all_deletions(repo, find_candidates(repo, ["pkg"]))
    assert len(deletions) == 2 * len(EXPECTED) + 3  # a line and a body each, a function for three
    for d in deletions:
        ast.parse(d.after)
        assert d.before == SAMPLE
    _assert_patches_restore(tmp_path, deletions)


@needs_patch
def test_crlf_tabs_and_no_final_newline(tmp_path: Path) -> None:
    text = "def f(a):\n\tb = a\n\tc = b\n\treturn c\n\n\ndef g():\n\treturn f(1)\n\n\n" \
        "def last(x):\n\ty = x\n\tz = y\n\treturn z"
    for variant in (text, text.replace("\n", "\r\n")):
        repo = _repo(tmp_path / str(len(variant)), variant)
        cands = find_candidates(repo, ["pkg"])
        assert [c.qualname for c in cands] == ["f", "last"]
        deletions = _all_deletions(repo, cands)
        bodies = [d for d in deletions if d.level == "body"]
        nl = "\r\n" if "\r\n" in variant else "\n"
        assert f"def f(a):{nl}\traise NotImplementedError{nl}{nl}{nl}def g" in bodies[0].after
        assert bodies[-1].after.endswith("\traise NotImplementedError")  # no newline added
        for d in (d for d in deletions if d.level == "line"):  # one whole line, its ending included
            assert d.removed.startswith("\t") and d.removed.count(nl) <= 1
            assert len(d.after.splitlines()) == len(variant.splitlines()) - 1
        _assert_patches_restore(tmp_path / str(len(variant)), deletions)
    assert "\\ No newline at end of file" in make_patch(text, deletions[-1].after, "pkg/mod.py")


def test_make_patch_format() -> None:
    before, after = "a\nb\nc\nd\ne\nf\ng\n", "a\nb\nc\nX\ne\nf\ng\n"
    p = make_patch(before, after, "pkg/m.py")
    assert p.splitlines()[:4] == ["diff --git a/pkg/m.py b/pkg/m.py", "--- a/pkg/m.py",
                                  "+++ b/pkg/m.py", "@@ -1,7 +1,7 @@"]
    assert "-X\n+d\n" in p  # turns the deleted text back into the original
    assert make_patch(before, before, "x.py") == ""


def test_git_apply_accepts_gold_patch(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    c = _by_name(find_candidates(repo, ["pkg"]))["Shape.scaled"]
    d = delete_in_repo(repo, c, "function")
    assert (repo / c.file).read_text() == d.after
    (tmp_path / "gold.patch").write_text(d.patch)
    r = subprocess.run(["git", "apply", "--unidiff-zero", str(tmp_path / "gold.patch")],
                       cwd=repo, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (repo / c.file).read_bytes() == SAMPLE.encode()


def test_definition_text(tmp_path: Path) -> None:
    c = _by_name(find_candidates(_repo(tmp_path), ["pkg"]))["Shape.scaled"]
    text = definition_text(SAMPLE, c)
    assert text.startswith("    @functools.lru_cache") and text.endswith("return Shape(w, h)\n")


def test_skips_tests_docs_and_uncovered(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    for name in ("pkg/tests/test_x.py", "pkg/test_mod.py", "pkg/mod_test.py", "pkg/conftest.py",
                 "pkg/docs/conf.py", "pkg/examples/demo.py", "pkg/setup.py"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(SAMPLE)
    (repo / "pkg/py2.py").write_text("print 'old'\n")
    (repo / "pkg/latin.py").write_bytes(b"# -*- coding: latin-1 -*-\nX = '\xe9'\n")
    assert {c.file for c in find_candidates(repo, ["pkg"])} == {"pkg/mod.py"}
    c = _by_name(find_candidates(repo, ["pkg"]))["unused"]
    covered = {"pkg/mod.py": {1, 2, 3, 7, 19, c.body_start_line}}
    assert [x.qualname for x in find_candidates(repo, ["pkg"], covered)] == ["unused"]
    absolute = {str((repo / "pkg/mod.py").resolve()): {c.end_lineno}}
    assert [x.qualname for x in find_candidates(repo, ["pkg"], absolute)] == ["unused"]
    assert find_candidates(repo, ["pkg"], {}) == []
    assert [x.qualname for x in find_candidates(repo, ["pkg/mod.py"])] == list(EXPECTED)
    with pytest.raises(DeletionError, match="does not exist"):
        find_candidates(repo, ["nope"])


@needs_patch
@pytest.mark.parametrize(
    "package", ["json", "textwrap.py", "email/message.py", "email/feedparser.py"])
def test_stdlib_every_deletion_parses_and_restores(tmp_path: Path, package: str) -> None:
    cands = find_candidates(STDLIB, [package])
    assert len(cands) >= 5
    assert len({c.id for c in cands}) == len(cands)
    for c in cands:
        assert c.n_statements >= 3 and c.n_body_lines <= 60
        assert not c.file.split("/")[-1].startswith("test_")
    deletions = _all_deletions(STDLIB, cands)
    for d in deletions:
        tree = ast.parse(d.after)
        if d.level == "body":
            assert "raise NotImplementedError" in d.after
        assert len(d.after) < len(d.before)
        assert tree is not None
    _assert_patches_restore(tmp_path, deletions)
