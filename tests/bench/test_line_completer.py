"""benchmarks/line_completer.py: a line task's gap is read from its gold patch (the file cut where the
line goes, the line itself); patches that are not one added line are refused by name; held-out splits
are refused; the completer's lines come back one per sample and the JSON line counts them."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from opencomposer.tasks.deletion.patch import make_patch
from testkit.scripts import load_benchmark

lc = load_benchmark("line_completer")

REL = "src/textwrap.py"


def _task(root: Path, name: str, drop: list[int]) -> tuple[Path, list[str]]:
    """A line task made from the standard library's textwrap.py with lines ``drop`` (0-based) deleted."""
    original = Path(textwrap.__file__).read_text()
    lines = original.splitlines(keepends=True)
    after = "".join(ln for i, ln in enumerate(lines) if i not in drop)
    d = root / name
    (d / "workspace" / "src").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "task.toml").write_text('format_version = 1\n')
    (d / "workspace" / REL).write_text(after)
    (d / "solution" / "gold.patch").write_text(make_patch(original, after, REL))
    return d, lines


def _statement(lines: list[str], start: int) -> int:
    """The first indented, non-blank, non-comment line at or after ``start``."""
    i = start
    while not (lines[i].startswith("        ") and lines[i].strip() and not lines[i].strip().startswith("#")):
        i += 1
    return i


def test_the_gap_is_the_file_before_the_deleted_line_and_the_line(tmp_path):
    probe = Path(textwrap.__file__).read_text().splitlines(keepends=True)
    i = _statement(probe, len(probe) // 2)
    d, lines = _task(tmp_path, "stdlib__textwrap__line", [i])
    gap = lc.read_gap(d)
    assert gap.gold == lines[i].rstrip("\n")
    assert gap.before == "".join(lines[:i])
    assert gap.library == "stdlib" and gap.task == d.name


def test_patches_that_are_not_one_added_line_are_refused_by_name(tmp_path):
    probe = Path(textwrap.__file__).read_text().splitlines(keepends=True)
    i = _statement(probe, len(probe) // 3)
    j = _statement(probe, len(probe) // 2)
    d, _ = _task(tmp_path, "two__lines", [i, j])
    with pytest.raises(lc.TaskError, match=r"two__lines/solution/gold.patch: adds 2 lines, expected 1"):
        lc.read_gap(d)


def test_a_held_out_split_is_refused(tmp_path, capsys):
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"validation": [], "heldout_functions": ["x__line"]}))
    with pytest.raises(SystemExit, match=r"--split heldout_functions: a held-out split is never measured"):
        lc.main(["--tasks", str(tmp_path), "--splits", str(splits), "--split", "heldout_functions"])
    with pytest.raises(SystemExit, match=r"no split 'train' \(has \['heldout_functions', 'validation'\]\)"):
        lc.main(["--tasks", str(tmp_path), "--splits", str(splits), "--split", "train"])


def test_the_completer_writes_a_line_per_sample_and_the_json_counts_them(tmp_path, capsys):
    probe = Path(textwrap.__file__).read_text().splitlines(keepends=True)
    ids = []
    for n, at in enumerate((len(probe) // 3, len(probe) // 2)):
        d, _ = _task(tmp_path / "tasks", f"stdlib__t{n}__line", [_statement(probe, at)])
        ids.append(d.name)
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"validation": ids + ["HumanEval_0"]}))
    rows = tmp_path / "rows.jsonl"
    result = lc.main(["--tasks", str(tmp_path / "tasks"), "--splits", str(splits), "--model", "tiny-random",
                      "--k", "3", "--max-new-tokens", "6", "--context-tokens", "64", "--out", str(rows)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["tasks"] == 2 and result["k"] == 3
    got = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [r["task"] for r in got] == ids
    for r in got:
        assert isinstance(r["greedy"], str) and "\n" not in r["greedy"] and 0 <= r["samples_ok"] <= 3
        assert r["greedy_ok"] == (r["greedy"].strip() == r["gold"].strip())
    assert result["greedy"] == sum(r["greedy_ok"] for r in got) / 2
