"""Session logs: append-only JSONL per window; torn/garbled lines are skipped with a warning."""

from __future__ import annotations

import json
import threading

import pytest

from opencomposer.inference.server.session_log import SessionLog, log_files, read_window

T0 = 1_800_000_000.0  # a window boundary for window_s = 100 (1.8e9 is divisible by 100)


def completion(t: float, sid: str = "s1", cid: str = "c1") -> dict:
    return {"type": "completion", "t": t, "id": cid, "session_id": sid, "arm": "a", "prompt_ids": [1, 2],
            "token_ids": [3], "logprobs": [-0.5], "latency_s": 0.1}


def test_rotates_per_window_and_reads_back_a_time_range(tmp_path):
    log = SessionLog(tmp_path, window_s=100, writer="w")
    for i, t in enumerate((T0 + 1, T0 + 50, T0 + 120, T0 + 250)):
        log.write(completion(t, cid=f"c{i}"))
    log.write({"type": "feedback", "t": T0 + 121, "session_id": "s1", "kind": "edit_kept"})
    log.close()
    files = log_files(tmp_path)
    assert [f.name for f in files] == ["20270115T080000Z-100s-w.jsonl", "20270115T080140Z-100s-w.jsonl",
                                       "20270115T080320Z-100s-w.jsonl"]
    assert log.path_for(T0 + 99).name == files[0].name  # the window is [T0, T0 + 100)
    w = read_window(tmp_path, since=T0 + 50, until=T0 + 200)
    assert [c["id"] for c in w.completions] == ["c1", "c2"]
    assert [f["kind"] for f in w.feedback] == ["edit_kept"]
    assert len(w.files) == 2 and not w.warnings  # the third file's window starts after `until`
    assert all(json.loads(line)["schema"] == "opencomposer.session/1" for f in files for line in f.open())


def test_torn_garbled_and_incomplete_lines_are_skipped_with_warnings(tmp_path):
    log = SessionLog(tmp_path, window_s=100, writer="w")
    log.write(completion(T0 + 1, cid="good"))
    log.close()
    path = log_files(tmp_path)[0]
    with path.open("a") as f:
        f.write("not json at all\n")
        f.write('["a", "list"]\n')
        f.write('{"type": "completion", "t": %f, "id": "x"}\n' % (T0 + 2))  # lacks token ids etc.
        f.write('{"type": "mystery", "t": 1}\n')
        f.write('{"type": "completion", "t": %f, "id": "torn", "session' % (T0 + 3))  # killed mid-write
    w = read_window(tmp_path, since=T0, until=T0 + 100)
    assert [c["id"] for c in w.completions] == ["good"]
    assert len(w.warnings) == 5
    assert f"{path}:2: unreadable JSON" in w.warnings[0]
    assert "expected a JSON object" in w.warnings[1]
    assert "lacks field(s) ['session_id', 'arm', 'prompt_ids'" in w.warnings[2]
    assert "field 'type' is 'mystery'" in w.warnings[3]
    assert f"{path}:6:" in w.warnings[4] and "torn last line" in w.warnings[4]


def test_concurrent_writers_never_interleave_lines(tmp_path):
    log = SessionLog(tmp_path, window_s=3600, writer="w")
    big = {"type": "completion", "session_id": "s", "arm": "a", "prompt_ids": list(range(3000)),
           "token_ids": [1], "logprobs": [0.0], "latency_s": 0.0}

    def write(k: int) -> None:
        for i in range(25):
            log.write({**big, "id": f"{k}-{i}"})

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    w = read_window(tmp_path)
    assert len(w.completions) == 100 and not w.warnings
    assert log.records == 100


def test_missing_log_dir_and_bad_window_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such log directory.*--log-dir"):
        read_window(tmp_path / "nope")
    with pytest.raises(ValueError, match="window_s must be >= 1"):
        SessionLog(tmp_path, window_s=0)
