"""benchmarks/rl_placement.py: an edit's place and text against a one-line task's gold patch."""

from __future__ import annotations

import json
from pathlib import Path
from testkit.scripts import load_benchmark

rp = load_benchmark("rl_placement")

GOLD = """diff --git a/toolz/_signatures.py b/toolz/_signatures.py
--- a/toolz/_signatures.py
+++ b/toolz/_signatures.py
@@ -762,6 +762,7 @@
 def _has_keywords(func):
     if func not in signatures:
         return None
+    sigs = signatures[func]
     checks = [check_keywords(sig) for sig in sigs]
"""


def _episode(d: Path, name: str, passed: bool, start: int, new: str) -> None:
    ev = {"name": "replace_lines", "ok": True,
          "arguments": {"path": "toolz/_signatures.py", "start_line": start, "end_line": start - 1, "new": new}}
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps({"task_id": "t1", "meta": {"rl": {"passed": passed}},
                                      "steps": [{"tool_events": [ev]}]}))


def test_edits_are_placed_against_the_gold_line(tmp_path):
    (tmp_path / "tasks" / "t1" / "solution").mkdir(parents=True)
    (tmp_path / "tasks" / "t1" / "solution" / "gold.patch").write_text(GOLD)
    tr = tmp_path / "transcripts"
    _episode(tr / "step-0001", "a.json", True, 765, "    sigs = signatures[func]\n")
    _episode(tr / "step-0001", "b.json", False, 767, "    sigs = None\n")
    _episode(tr / "step-0002", "c.json", False, 700, "    return sigs\n")
    assert rp.placement(tr, [tmp_path / "tasks"]) == {
        "pass episodes": 1, "pass right file": 1, "pass right line": 1, "pass within 2 lines": 1, "pass gold text": 1,
        "other episodes": 2, "other right file": 2, "other right line": 0, "other within 2 lines": 1,
        "other gold text": 0}
    assert rp.main([str(tmp_path / "nowhere")]) == 2
