"""The Triton kernels on the CPU: runs ``interp_triton_checks.py`` under Triton's
interpreter (``TRITON_INTERPRET=1``, which must be set before Triton is imported, hence a
subprocess). Skipped where Triton is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.slow  # ~25 s quiet, ~50 s on a loaded 2-core VM: the interpreter runs kernels in numpy
def test_triton_kernels_under_the_interpreter():
    checks = Path(__file__).with_name("interp_triton_checks.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checks)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
