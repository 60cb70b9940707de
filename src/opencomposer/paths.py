"""Where opencomposer keeps caches: ``$OPENCOMPOSER_CACHE`` or ``~/.cache/opencomposer``."""

from __future__ import annotations

import os
from pathlib import Path


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
