"""Freed tensor memory back to the operating system at once, on the CPU (glibc).

    return_freed_memory()     # Trainer does this on the CPU with [train] return_host_memory = true

glibc serves allocations below its mmap threshold from the heap, and raises that threshold
(up to 32 MiB) each time a large block is freed; a training step's activations (8k tokens x 576
x 4 B = 19 MB each) then live in the heap, whose freed holes stay resident. Measured on the
embedded model with 4k-token packed, checkpointed micro-batches (benchmarks/RESULTS.md, issue 32):
the resident set after a backward was 2.9 GB instead of 1.5 GB, and peaked at 5.0 GB instead of
2.7 GB. A fixed 256 KiB threshold maps every larger tensor on its own and unmaps it on free.
Process-wide; a no-op where libc is not glibc.

Test: ``pytest tests/unit/train/test_packing.py``.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
THRESHOLD_BYTES = 256 * 1024


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at 256 KiB; True when it took effect."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES))
