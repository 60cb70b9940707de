"""CursorBench-style evaluation: suites (``suite.py``), running them (``run.py``), the
results file and its metrics (``results.py``), the regression gate (``gate.py``) and the
HTML/PNG report (``report.py``); ``heldout.py`` is the small in-run eval of training.

    from opencomposer.eval import load_suite, run_suite, compare

Names load lazily, so importing the gate does not import the model stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {"load_suite": "suite", "Suite": "suite", "run_suite": "run", "compare": "gate",
          "GateResult": "gate", "load_results": "results", "build_report": "report"}


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"opencomposer.eval.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'opencomposer.eval' has no attribute {name!r}")
