"""Fixtures for the trainer tests: a fresh tiny-random model per test (training mutates it)."""

from __future__ import annotations

import pytest

from opencomposer.models import load_model


@pytest.fixture
def tiny():
    """A fresh (model, tokenizer); tiny-random weights are the same on every load."""
    return load_model("tiny-random")
