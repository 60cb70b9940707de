"""benchmarks/pyspy_summary.py: thread groups, GIL share and the error on a line that is not py-spy's raw format."""

from __future__ import annotations

import gzip
import json

import pytest
from testkit.scripts import load_benchmark

ps = load_benchmark("pyspy_summary")

# three threads as py-spy 0.4 writes them under --gil --threads --format raw (one line per distinct stack)
RAW = """\
thread (101): Thread-3 (_serve);Thread.run (threading.py:982);BatchedPolicy._serve (/w/src/opencomposer/policies/batched.py:246);Engine.step (/w/src/opencomposer/inference/engine/core.py:201) 30
thread (101): Thread-3 (_serve);Thread.run (threading.py:982);BatchedPolicy._serve (/w/src/opencomposer/policies/batched.py:250);Engine.step (/w/src/opencomposer/inference/engine/core.py:205) 10
thread (202): Thread-17 (episode);Thread.run (threading.py:982);encode (/w/src/opencomposer/policies/model.py:77);apply_chat_template (transformers/tokenization_utils_base.py:1600) 45
thread (203): Thread-18 (episode);Thread.run (threading.py:982);encode (/w/src/opencomposer/policies/model.py:80) 15
"""


def test_groups_threads_by_name_and_attributes_samples_to_the_innermost_project_frame(tmp_path, capsys):
    p = tmp_path / "pyspy.txt.gz"
    with gzip.open(p, "wt") as f:
        f.write(RAW)
    assert ps.main([str(p), "--seconds", "4", "--rate", "50"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["samples"] == 100 and s["gil_busy_share"] == 0.5  # 100 samples of 200 taken
    assert list(s["groups"]) == ["Thread-N (episode)", "Thread-N (_serve)"]  # most samples first
    ep, serve = s["groups"]["Thread-N (episode)"], s["groups"]["Thread-N (_serve)"]
    assert ep["share"] == 0.6 and serve["share"] == 0.4
    # lines 77 and 80 of one function merge; a library frame inside it is charged to the project frame
    assert ep["top"] == [["encode (/w/src/opencomposer/policies/model.py)", 0.6]]
    assert serve["top"] == [["Engine.step (/w/src/opencomposer/inference/engine/core.py)", 0.4]]


def test_a_line_without_a_count_names_the_file_and_line(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_text(RAW + "thread (9): MainThread;main (x.py:1)\n")
    with pytest.raises(SystemExit, match=r"bad.txt:5: expected 'thread \(TID\): NAME;frames COUNT'"):
        ps.main([str(p)])
