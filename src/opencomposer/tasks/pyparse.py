"""``parse``: ``ast.parse`` under one process-wide lock.

CPython 3.11 keeps the AST constructor's recursion depth in interpreter state that threads
share; when the factory's worker threads (or the graders of concurrent rollouts,
``grading/grade.py``) parse at the same time (a garbage collection inside
one thread's conversion lets another run), ``ast.parse`` raises a spurious
``SystemError: AST constructor recursion depth mismatch`` (cpython gh-106905; seen here on
3.11.7 in ``tests/integration/test_rl_run.py``'s task fixture). Parsing is a small share of a
candidate's time next to its test runs, so serialising it costs nothing measurable.
"""

from __future__ import annotations

import ast
import threading

_LOCK = threading.Lock()


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    with _LOCK:
        return ast.parse(source, filename)
