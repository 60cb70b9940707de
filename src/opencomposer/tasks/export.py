"""Export task directories to other formats: SWE-bench JSONL or Harbor task directories.

    opencomposer tasks export swebench tasks/ --out rows.jsonl --repos-out clones/
    opencomposer tasks export harbor tasks/ --out harbor-tasks/

The per-format writers live in ``tasks/sources/`` next to their importers; this module
walks the task dirs, reports unreadable ones (file and reason) and goes on.

Test: ``pytest tests/integration/test_task_formats.py``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from opencomposer.paths import atomic_write_text
from opencomposer.tasks.format import Task, TaskFormatError, find_tasks
from opencomposer.tasks.sources import ImportReport

FORMATS = ("swebench", "harbor")


def export_tasks(fmt: str, paths: list[Path], out: Path, repos_out: Path | None = None) -> ImportReport:
    """Write every task under ``paths`` to ``out`` in ``fmt``; the report counts ok/failed."""
    from opencomposer.tasks.sources import harbor_export, swebench

    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {', '.join(FORMATS)}")
    t0 = time.time()
    report = ImportReport(f"{fmt}:{out}")
    out = Path(out)
    rows = []
    if fmt == "harbor":
        out.mkdir(parents=True, exist_ok=True)
    elif repos_out is not None:
        Path(repos_out).mkdir(parents=True, exist_ok=True)
    for p in find_tasks([Path(x) for x in paths]):
        try:
            task = Task.load(p)
            if fmt == "harbor":
                harbor_export.export_task(task, out)
            else:
                rows.append(swebench.task_row(task, repos_out))
            report.ok.append(task.id)
        except (TaskFormatError, OSError, RuntimeError, ValueError) as e:
            report.failed[p.name] = f"{p}: {e}"
    if fmt == "swebench":
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in rows))
    report.seconds = time.time() - t0
    return report
