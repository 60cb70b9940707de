"""Where opencomposer keeps caches: ``$OPENCOMPOSER_CACHE`` or ``~/.cache/opencomposer``."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def cache_dir(*parts: str) -> Path:
    root = Path(os.environ.get("OPENCOMPOSER_CACHE", Path.home() / ".cache" / "opencomposer"))
    p = root.joinpath(*parts)
    p.mkdir(parents=True, exist_ok=True)
    return p


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file + rename: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Build a directory in a temp dir beside ``final``; it replaces ``final`` only when the
    block succeeds (a reader never sees half of it), and is removed when the block raises."""
    final = Path(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name[:40]}-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
