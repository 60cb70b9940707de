"""Where opencomposer keeps caches: ``$OPENCOMPOSER_CACHE`` or ``~/.cache/opencomposer``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    root = Path(os.environ.get("OPENCOMPOSER_CACHE", Path.home() / ".cache" / "opencomposer"))
    p = root.joinpath(*parts)
    p.mkdir(parents=True, exist_ok=True)
    return p
