"""``parse``: ``ast.parse`` under one process-wide lock.

CPython 3.11 keeps the AST constructor's recursion depth in interpreter state that threads
share; when threads parse at the same time (the factory's workers, the graders of concurrent
rollouts in ``grading/grade.py``, the edit tools' check in ``harness/fs_tools.py``; a garbage
collection inside one thread's conversion lets another run), ``ast.parse`` raises a spurious
``SystemError: AST constructor recursion depth mismatch`` (cpython gh-106905; seen here on
3.11.7 in ``tests/integration/test_rl_run.py``'s task fixture). Parsing is a small share of a
candidate's time next to its test runs, so serialising it costs nothing measurable.

The code parsed is library code and what an agent wrote: its warnings (an invalid escape such
as ``'\\w'`` in a plain string: a ``SyntaxWarning`` on 3.12, a ``DeprecationWarning`` before)
say nothing to whoever runs the parse, and during RL they filled the log with
``<unknown>:150: SyntaxWarning`` lines, so they are not shown.

Test: ``pytest tests/unit/test_pyparse.py``.
"""

from __future__ import annotations

import ast
import threading
import warnings

_LOCK = threading.Lock()


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    with _LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return ast.parse(source, filename)
