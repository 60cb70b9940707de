"""Session logs of ``opencomposer serve --log-dir DIR``: append-only JSONL, one file per window.

    log = SessionLog("runs/serve-logs", window_s=3600)      # the server writes
    log.write({"type": "completion", ...})
    window = read_window("runs/serve-logs", since=t0, until=t1)   # the real-time loop reads
    window.completions, window.feedback, window.warnings

Every served chat completion is one ``completion`` record; every ``POST /v1/feedback`` is
one ``feedback`` record (``inference/server/front.py``). A completion record holds what training
needs to use it as a policy-gradient sample without re-rendering anything: the prompt's
token ids, the sampled token ids and the sampler's log-probs (``log_softmax(logits / T)``,
the trainer's convention), the temperature, and which arm / checkpoint / weights version
served it; plus the request messages and tools, the text, the parsed tool calls and the
latency, for people and for the A/B report.

Files: ``DIR/<window start, UTC>-<window_s>s-<writer>.jsonl``. A new file starts when the
clock passes into the next window, so a cycle of the real-time loop reads whole files and
the rest can be archived. Each record is one ``write`` of one line followed by ``flush``,
so a killed server leaves at most its last line torn; readers skip a torn or garbled line
with a warning naming the file and line and go on (``fsync=True`` also survives power loss,
at about a millisecond per record).

Test: ``pytest tests/unit/inference/test_session_log.py``.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SCHEMA = "opencomposer.session/1"
_NAME = re.compile(r"^(\d{8}T\d{6}Z)-(\d+)s-(.+)\.jsonl$")
# fields every record of a kind must have, to be usable at all
REQUIRED = {
    "completion": ("t", "id", "session_id", "arm", "prompt_ids", "token_ids", "logprobs", "latency_s"),
    "feedback": ("t", "session_id", "kind"),
}


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y%m%dT%H%M%SZ")


def _parse_stamp(s: str) -> float:
    return datetime.strptime(s, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC).timestamp()


class SessionLog:
    """Thread-safe appender; rotates to a new file at each window boundary."""

    def __init__(self, dir: str | Path, window_s: float = 3600.0, writer: str | None = None, fsync: bool = False):
        if window_s < 1:
            raise ValueError(f"window_s must be >= 1 second, got {window_s}")
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.window_s = int(window_s)
        self.writer = re.sub(r"[^A-Za-z0-9_.-]", "_", writer or f"serve-{os.getpid()}")
        self.fsync = fsync
        self._lock = threading.Lock()
        self._file: Any = None
        self._window = -1
        self.records = 0

    def path_for(self, t: float) -> Path:
        start = int(t // self.window_s) * self.window_s
        return self.dir / f"{_stamp(start)}-{self.window_s}s-{self.writer}.jsonl"

    def write(self, record: dict[str, Any]) -> None:
        record = {"schema": SCHEMA, "t": time.time(), **record}
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock:
            window = int(record["t"] // self.window_s)
            if window != self._window:
                self._close()
                self._file = open(self.path_for(record["t"]), "a", encoding="utf-8")
                self._window = window
            self._file.write(line)
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
            self.records += 1

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        with self._lock:
            self._close()


@dataclass
class LogWindow:
    """The records of ``[since, until)``, sorted by time, and what could not be read."""

    since: float
    until: float
    completions: list[dict] = field(default_factory=list)
    feedback: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.completions


def log_files(dir: str | Path, since: float = 0.0, until: float = float("inf")) -> list[Path]:
    """Log files whose window overlaps ``[since, until)``, oldest first."""
    root = Path(dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such log directory (start the server with --log-dir {root})")
    out = []
    for p in sorted(root.iterdir()):
        m = _NAME.match(p.name)
        if not m:
            continue
        start = _parse_stamp(m.group(1))
        if start < until and start + int(m.group(2)) > since:
            out.append(p)
    return out


def iter_records(path: Path, warnings: list[str]) -> Iterator[dict]:
    """Records of one file; torn, garbled or incomplete lines become warnings."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                torn = "" if line.endswith("\n") else " (torn last line: the writer was killed mid-write?)"
                warnings.append(f"{path}:{n}: unreadable JSON skipped{torn}: {e.msg} at char {e.pos}")
                continue
            if not isinstance(rec, dict):
                warnings.append(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}; skipped")
                continue
            kind = rec.get("type")
            if kind not in REQUIRED:
                warnings.append(f"{path}:{n}: field 'type' is {kind!r}, expected one of {sorted(REQUIRED)}; skipped")
                continue
            missing = [k for k in REQUIRED[kind] if k not in rec]
            if missing:
                warnings.append(f"{path}:{n}: {kind} record lacks field(s) {missing}; skipped")
                continue
            yield rec


def read_window(dir: str | Path, since: float = 0.0, until: float | None = None) -> LogWindow:
    """Every record with ``since <= t < until`` (``until`` default: now)."""
    until = time.time() if until is None else until
    w = LogWindow(since, until)
    for p in log_files(dir, since, until):
        w.files.append(str(p))
        for rec in iter_records(p, w.warnings):
            if since <= float(rec["t"]) < until:
                (w.completions if rec["type"] == "completion" else w.feedback).append(rec)
    w.completions.sort(key=lambda r: r["t"])
    w.feedback.sort(key=lambda r: r["t"])
    return w


def session_id(headers: Any, body_extra: dict | None) -> str | None:
    """The session a request belongs to: the ``X-Session-Id`` header, else the request's
    ``user`` field (OpenAI's end-user id), else None (logged, routed to arm ``a``)."""
    sid = headers.get("x-session-id") if headers is not None else None
    if not sid and body_extra:
        user = body_extra.get("user")
        sid = user if isinstance(user, str) else None
    return sid or None


def completion_record(*, rid: str, index: int, sid: str | None, arm: str, checkpoint: str, model: str,
                      messages: list, tools: list | None, temperature: float, top_p: float,
                      prompt_ids: list[int], token_ids: list[int], logprobs: list[float],
                      policy_versions: list[int], text: str, tool_calls: list, finish_reason: str | None,
                      latency_s: float, stream: bool) -> dict[str, Any]:
    """One served choice as a ``completion`` record (see the module docstring)."""
    return {
        "type": "completion", "id": f"{rid}:{index}", "session_id": sid, "arm": arm, "checkpoint": checkpoint,
        "model": model, "policy_version": policy_versions[0] if policy_versions else None,
        "messages": messages, "tools": tools or [], "temperature": temperature, "top_p": top_p,
        "prompt_ids": prompt_ids, "token_ids": token_ids, "logprobs": logprobs, "text": text,
        "tool_calls": tool_calls, "finish_reason": finish_reason, "latency_s": round(latency_s, 4),
        "prompt_tokens": len(prompt_ids), "completion_tokens": len(token_ids), "stream": stream,
    }
