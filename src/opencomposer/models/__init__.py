"""Local models: loading (``registry``), the prompt (``chat``), tool calls in model text (``codec``).

    from opencomposer.models import load_model, render_prompt

Names are resolved lazily so that ``import opencomposer.models.chat`` (no torch needed)
stays cheap, and importing this package never loads torch by itself.

Test: ``pytest tests/unit/models -m "not slow"`` (~25 s on 2 cores); drop the ``-m`` to
add the real SmolLM2-135M test (``test_models_smollm2.py``, about a minute).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_model": "registry",
    "ModelLoadError": "registry",
    "KNOWN_NAMES": "registry",
    "DEFAULT_MODEL": "registry",
    "render_prompt": "chat",
    "encode_prompt": "chat",
    "PromptError": "chat",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'opencomposer.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"opencomposer.models.{_EXPORTS[name]}"), name)
