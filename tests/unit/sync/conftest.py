"""A trainer's model and an engine on a copy of its weights (tiny random Qwen2, CPU)."""

from __future__ import annotations

import pytest
import torch

from opencomposer.inference.engine.core import Engine
from opencomposer.models.registry import load_model
from opencomposer.sync.store import FileStore


@pytest.fixture
def trainer_model():
    hf, _tok = load_model("tiny-random")
    return hf


@pytest.fixture
def make_engine(trainer_model):
    def make(dtype=torch.float32, model=None):
        return Engine(model or trainer_model, None, max_model_len=128, dtype=dtype, max_num_seqs=4)
    return make


@pytest.fixture
def store(tmp_path):
    return FileStore(tmp_path / "weights")


def train_step(model, seed: int, lr: float = 1e-3) -> None:
    """One optimizer step on random tokens: what changes between two published versions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=g)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
