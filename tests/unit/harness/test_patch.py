"""The unified-diff parser and applier used by the oracle."""

from __future__ import annotations

import difflib
import shutil
import subprocess

import pytest

from opencomposer.harness.patch import PatchError, apply_hunks, apply_patch, parse_patch, split_lines

OLD = "".join(f"line {i}\n" for i in range(1, 41))


def udiff(old: str, new: str, path: str = "pkg/mod.py", git: bool = True) -> str:
    a, b = (f"a/{path}", f"b/{path}") if git else (path, path)
    # split_lines, not str.splitlines: a form feed inside a line must not end it
    return "".join(difflib.unified_diff(split_lines(old), split_lines(new), a, b))


def test_several_hunks_round_trip():
    new = OLD.replace("line 3\n", "line three\n").replace("line 30\n", "line 30\nadded\n")
    new = new.replace("line 20\n", "")
    patch = udiff(OLD, new)
    (fp,) = parse_patch(patch)
    assert fp.path == "pkg/mod.py" and len(fp.hunks) == 3
    assert apply_patch({"pkg/mod.py": OLD}, patch) == {"pkg/mod.py": new}


def test_hunk_sides():
    (fp,) = parse_patch(udiff(OLD, OLD.replace("line 10\n", "ten\n")))
    (h,) = fp.hunks
    assert h.old_text == "".join(f"line {i}\n" for i in range(7, 14))
    assert h.new_text == h.old_text.replace("line 10\n", "ten\n")


def test_several_files_new_and_deleted_files():
    patch = (
        udiff(OLD, OLD.replace("line 5\n", "five\n"), "a.py")
        + udiff("", "brand\nnew\n", "b.py").replace("--- a/b.py", "--- /dev/null")
        + udiff("gone\n", "", "c.py").replace("+++ b/c.py", "+++ /dev/null")
    )
    fps = parse_patch(patch)
    assert [(f.path, f.is_new, f.is_delete) for f in fps] == [("a.py", False, False), ("b.py", True, False), ("c.py", False, True)]
    out = apply_patch({"a.py": OLD, "c.py": "gone\n"}, patch)
    assert out == {"a.py": OLD.replace("line 5\n", "five\n"), "b.py": "brand\nnew\n", "c.py": None}


@pytest.mark.skipif(not shutil.which("diff"), reason="needs diff")
def test_no_newline_at_end_of_file_from_real_diff(tmp_path):
    (tmp_path / "old").write_text("a\nb\nc")
    (tmp_path / "new").write_text("a\nB\nc\nd")
    patch = subprocess.run(["diff", "-u", "old", "new"], cwd=tmp_path, capture_output=True, text=True).stdout
    assert "No newline" in patch
    assert apply_patch({"old": "a\nb\nc"}, patch.replace("+++ new", "+++ old")) == {"old": "a\nB\nc\nd"}


def test_hunks_apply_at_an_offset_and_pick_the_nearest_duplicate():
    block = "def f():\n    pass\n"
    old = block + "x\n" * 20 + block + "y\n" * 20
    new = block + "x\n" * 20 + "def f():\n    return 1\n" + "y\n" * 20
    (fp,) = parse_patch(udiff(old, new))
    shifted = "header\n" * 7 + old  # the file grew above the hunk
    assert apply_hunks(shifted, fp.hunks) == "header\n" * 7 + new


def test_only_newlines_end_lines():
    old = "a = 1\n\x0c\nb = 2\nc = 3\n"
    new = old.replace("b = 2", "b = 20")
    assert apply_patch({"f.py": old}, udiff(old, new, "f.py")) == {"f.py": new}


def test_git_headers_are_skipped_and_prefixes_stripped():
    patch = "diff --git a/x.py b/x.py\nindex 123..456 100644\n" + udiff("1\n", "2\n", "x.py")
    assert parse_patch(patch)[0].path == "x.py"
    assert parse_patch(udiff("1\n", "2\n", "x.py", git=False))[0].path == "x.py"


def test_errors_are_clear():
    patch = udiff(OLD, OLD.replace("line 10\n", "ten\n"))
    with pytest.raises(PatchError, match=r"pkg/mod.py: hunk 1 of 1 \(old line 7\) does not apply"):
        apply_patch({"pkg/mod.py": "something else\n"}, patch)
    with pytest.raises(PatchError, match="does not exist"):
        apply_patch({}, patch)
    with pytest.raises(PatchError, match="no file in patch"):
        parse_patch("just prose\n")
    with pytest.raises(PatchError, match="cut short|ends early"):
        parse_patch("\n".join(patch.splitlines()[:5]) + "\n")
    with pytest.raises(PatchError, match="bad hunk header"):
        parse_patch("--- a/x\n+++ b/x\n@@ nonsense @@\n")
