"""Deletion levels beyond body/function: a line, a block, a class, a feature across two files.
Every deletion parses, leaves the rest byte-identical, and its gold patch restores the
original under GNU ``patch -p1``; the instruction names what is missing, not the code."""

from __future__ import annotations

import ast
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from opencomposer.tasks.deletion import (
    LEVELS,
    DeletionError,
    definition_text,
    delete,
    delete_feature,
    find_candidates,
    find_features,
    read_source,
)
from opencomposer.tasks.deletion.candidates import pick_line
from opencomposer.tasks.instructions import make_instruction

needs_patch = pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch not installed")

SHAPES = '''\
"""Shapes."""
from pkg.util import clamp, norm


class Box:
    """An axis-aligned box."""

    def __init__(self, w, h):
        self.w = clamp(w, 0, 100)
        self.h = clamp(h, 0, 100)

    def area(self):
        total = self.w * self.h
        if total > 50:
            # big boxes are rounded
            total = round(total, -1)
            total = int(total)
        return total

    def ratio(self, other):
        mine = self.area()
        theirs = other.area()
        return mine / theirs


def describe(box):
    """Describe a box in words."""
    size = norm(box.area())
    words = []
    for part in ("w", "h"):
        value = getattr(box, part)
        words.append(f"{part}={value}")
    return " ".join(words) + f" size={size}"


def make(n):
    out = []
    out.append(Box(n, n))
    return describe(out[0])
'''

UTIL = '''\
def clamp(x, lo, hi):
    if x < lo:
        return lo
    return min(x, hi)


def norm(x):
    """Scale to 0..1."""
    x = float(x)
    x = x / 10000
    return round(x, 3)
'''


def _repo(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "shapes.py").write_text(SHAPES)
    (tmp_path / "pkg" / "util.py").write_text(UTIL)
    return tmp_path


def _restore(tmp_path: Path, files: dict[str, tuple[str, str]], patch: str) -> None:
    work = tmp_path / "restore"
    for rel, (_, after) in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(after)
    r = subprocess.run(["patch", "-p1", "-s"], input=patch, text=True, cwd=work, capture_output=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    for rel, (before, _) in files.items():
        assert (work / rel).read_text() == before
    shutil.rmtree(work)


def test_levels_are_ranked() -> None:
    assert LEVELS == ("line", "block", "body", "function", "class", "feature")


@needs_patch
def test_line_level(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    cands = {c.qualname: c for c in find_candidates(repo, ["pkg"])}
    area = cands["Box.area"]
    # one-line simple statements not alone in their suite: 13, 16, 17 (inside the `if`), 18
    assert area.line in (13, 16, 17, 18) and area.levels[0] == "line"
    d = delete(read_source(repo / area.file), area, "line")
    assert d.removed == SHAPES.splitlines(keepends=True)[area.line - 1]
    assert d.after.count("\n") == SHAPES.count("\n") - 1
    ast.parse(d.after)
    _restore(tmp_path, d.files, d.patch)
    # the same source always gives the same line; given coverage, only an executed line is offered
    assert {c.qualname: c.line for c in find_candidates(repo, ["pkg"])} == {q: c.line for q, c in cands.items()}
    covered = {"pkg/shapes.py": set(range(12, 16)) | {18, 26, 27}}
    again = {c.qualname: c for c in find_candidates(repo, ["pkg"], covered)}
    assert again["Box.area"].line in (13, 18)
    text = make_instruction(area, "line", definition_text(d.before, area), random.Random(0))
    assert "`Box.area`" in text and "line" in text and d.removed.strip() not in text


def test_pick_line_skips_what_tests_cannot_see() -> None:
    src = (
        "def f(x):\n"
        '    """Doc."""\n'
        "    if x:\n"
        "        return None\n"       # return None: nothing the tests could tell apart
        "    y: int\n"                # annotation without a value
        "    pass\n"
        "    a = 1; b = 2\n"          # shares its line
        "    z = (x +\n"
        "         1)\n"               # two lines: not "a line"
        "    return\n"
    )
    body = ast.parse(src).body[0].body[1:]
    assert pick_line(body, src.splitlines(keepends=True), None, "k") is None
    ok = src.replace("    pass\n", "    log(x)\n")
    assert pick_line(ast.parse(ok).body[0].body[1:], ok.splitlines(keepends=True), None, "k") == 6
    # the only statement of its suite is never taken (the suite would be left empty)
    alone = "def g(x):\n    for i in x:\n        total = i\n    return total\n"
    assert pick_line(ast.parse(alone).body[0].body, alone.splitlines(keepends=True), None, "k") == 4


@needs_patch
def test_block_level(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    cands = {c.qualname: c for c in find_candidates(repo, ["pkg"])}
    area, desc = cands["Box.area"], cands["describe"]
    # the largest executed compound statement that is not the whole suite
    assert area.block == (14, 17) and "block" in area.levels
    assert desc.block == (30, 32)
    d = delete(read_source(repo / area.file), area, "block")
    assert "if total > 50" not in d.after and "return total" in d.after
    assert d.removed.startswith("        if total > 50:") and "# big boxes" in d.removed
    ast.parse(d.after)
    _restore(tmp_path, d.files, d.patch)
    # given coverage, only a block with an executed line is offered
    covered = {"pkg/shapes.py": {12, 13, 18}}
    assert {c.qualname: c.block for c in find_candidates(repo, ["pkg"], covered)}["Box.area"] is None
    text = make_instruction(area, "block", definition_text(d.before, area), random.Random(0))
    assert "`Box.area`" in text and "pkg/shapes.py" in text and "round(" not in text


@needs_patch
def test_class_level(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    assert not [c for c in find_candidates(repo, ["pkg"]) if c.kind == "class"]  # opt-in
    box = {c.qualname: c for c in find_candidates(repo, ["pkg"], classes=True)}["Box"]
    assert box.kind == "class" and box.levels == ("class",)
    d = delete(read_source(repo / box.file), box, "class")
    assert 'class Box:\n    """An axis-aligned box."""\n    pass\n\n\ndef describe' in d.after
    assert "def area" not in d.after and "__init__" not in d.after
    _restore(tmp_path, d.files, d.patch)
    with pytest.raises(DeletionError, match="not allowed"):
        delete(d.before, box, "body")
    text = make_instruction(box, "class", definition_text(d.before, box), random.Random(1))
    assert "`Box`" in text and "self.w" not in text


@needs_patch
def test_feature_spans_files(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    cands = find_candidates(repo, ["pkg"])
    feats = {f.anchor.qualname: f for f in find_features(cands)}
    feat = feats["describe"]  # describe calls norm (util.py); box.area() is not resolvable
    assert [m.qualname for m in feat.members] == ["describe", "norm"]
    assert [m.qualname for m in feats["Box.ratio"].members] == ["Box.ratio", "Box.area"]  # self.area()
    assert feat.files == ["pkg/shapes.py", "pkg/util.py"]
    d = delete_feature(repo, feat)
    assert set(d.files) == {"pkg/shapes.py", "pkg/util.py"}
    for rel, (before, after) in d.files.items():
        ast.parse(after)
        assert after.count("raise NotImplementedError") == sum(m.file == rel for m in feat.members)
    assert d.patch.count("diff --git") == 2
    _restore(tmp_path, d.files, d.patch)
    text = make_instruction(d.candidate, "feature", definition_text(d.before, d.candidate),
                            random.Random(2), members=d.members)
    assert "`describe`" in text and "`norm` (pkg/util.py)" in text
    assert "getattr" not in text
