"""benchmarks/lint_locate.py: a deletion that leaves a name undefined is counted as a finding near its gap;
one that leaves the file clean is not; held-out splits are refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from opencomposer.harness.lint import ruff_binary
from opencomposer.tasks.deletion.patch import make_patch
from testkit.scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
ll = load_benchmark("lint_locate")

pytestmark = pytest.mark.skipif(ruff_binary() is None, reason="ruff is not installed")

SOURCE = "def area(w, h):\n    size = w * h\n    half = size / 2\n    return half * 2\n\n\ndef noop():\n    x = 1\n    return x\n"


def _task(root: Path, name: str, line: str) -> str:
    after = SOURCE.replace(line, "", 1)
    d = root / name
    (d / "workspace" / "pkg").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "task.toml").write_text("format_version = 1\n")
    (d / "workspace" / "pkg" / "geo.py").write_text(after)
    (d / "solution" / "gold.patch").write_text(make_patch(SOURCE, after, "pkg/geo.py"))
    return name


def test_an_undefined_name_next_to_the_gap_is_counted_and_a_clean_gap_is_not(tmp_path, capsys):
    ids = [_task(tmp_path, "lib__area__line", "    size = w * h\n"),  # `size` undefined on the next line
           _task(tmp_path, "lib__noop__line", "    x = 1\n")]          # `x` undefined: also near
    ids.append(_task(tmp_path, "lib__half__line", "    half = size / 2\n"))
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": ids, "heldout_functions": []}))
    result = ll.main(["--tasks", str(tmp_path), "--splits", str(splits), "--split", "train"])
    assert result["train"]["tasks"] == 3 and result["train"]["new_finding"] == 3
    assert result["train"]["within_3"] == 3 and result["train"]["codes"]["F821"] >= 3
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["train"] == result["train"]
    with pytest.raises(SystemExit, match="held-out split is never measured"):
        ll.main(["--tasks", str(tmp_path), "--splits", str(splits), "--split", "heldout_functions"])


def test_a_deletion_that_leaves_no_new_finding_is_not_counted(tmp_path):
    source = "def f(a):\n    a.append(1)\n    a.append(2)\n    return a\n"
    after = source.replace("    a.append(2)\n", "")
    d = tmp_path / "lib__f__line"
    (d / "workspace").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "task.toml").write_text("format_version = 1\n")
    (d / "workspace" / "m.py").write_text(after)
    (d / "solution" / "gold.patch").write_text(make_patch(source, after, "m.py"))
    at, found = ll.new_findings(d, ruff_binary())
    assert at == 3 and found == []
