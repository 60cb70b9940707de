"""The scripts of ``benchmarks/`` as modules, for the bench tier's tests (they are files, not a package).

    cp = load_benchmark("carry_parts")                       # benchmarks/carry_parts.py
    bf = load_benchmark("bench_fail_fast")

Each is registered in ``sys.modules`` under its file's stem before it runs (pydantic resolves a
module's annotations through ``sys.modules``; a dataclass needs its module there too).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(stem: str) -> ModuleType:
    """``benchmarks/<stem>.py`` imported as the module ``stem`` (once per process)."""
    if stem in sys.modules:
        return sys.modules[stem]
    spec = importlib.util.spec_from_file_location(stem, BENCHMARKS / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[stem] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[stem]
        raise
    return module
