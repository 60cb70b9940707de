"""``train/document_attention.py``: FlexAttention's mask is the SDPA loop's, token for token, on
rows of several documents and shared-prefix pieces; eager flex attention over it gives the SDPA
loop's outputs; ``[train] document_attention`` refuses "flex" where it cannot run, saying why.
The compiled kernel and its gradients: ``tests/gpu/test_document_attention_cuda.py``."""

from __future__ import annotations

import sys

import pytest
import torch
from pydantic import ValidationError
from torch.nn.attention.flex_attention import create_mask, flex_attention

from opencomposer.models import load_model
from opencomposer.train import TrainConfig, Trainer
from opencomposer.train.document_attention import _block_mask, attention_kind, document_sdpa

R = range


def _positions(*pieces: range) -> list[int]:
    return [p for r in pieces for p in r]


# documents start at position 0; a piece starting at q > 0 shares the first q tokens of the row's
# last document that started at 0 (301 tokens: 128-token blocks skipped, full and partial)
ROWS = {
    "documents and shared prefixes": _positions(R(140), R(10, 14), R(13, 60), R(0, 70), R(5, 44), R(60, 61)),
    "one document": _positions(R(301)),
    "a piece at the very end": _positions(R(200), R(0, 90), R(3, 13), R(89, 90)),
}


def _sdpa_mask(pos: torch.Tensor) -> torch.Tensor:
    """(rows, tokens, tokens): which keys each query of the SDPA loop attends to, read off its
    output: equal queries weigh the keys they see equally, and value j is the j-th unit vector."""
    rows, n = pos.shape
    q = torch.zeros(rows, 2, n, n)
    v = torch.eye(n).expand(rows, 1, n, n)
    out, _ = document_sdpa(None, q, v, v, None, position_ids=pos)
    return out[:, :, 0] > 0


@pytest.mark.parametrize("layout", [*ROWS, "two rows, two layouts"])
def test_the_flex_mask_is_the_sdpa_loops(layout):
    if layout in ROWS:
        pos = torch.tensor([ROWS[layout]])
    else:
        pos = torch.tensor([ROWS["documents and shared prefixes"], ROWS["a piece at the very end"]])
    rows, n = pos.shape
    expected = _sdpa_mask(pos)
    assert expected.tril().equal(expected)  # never a later key
    flex = create_mask(_block_mask(pos, rows, n, pos.device).mask_mod, rows, 1, n, n, device="cpu")[:, 0]
    assert flex.equal(expected)
    if layout == "documents and shared prefixes":  # the first tokens of the pieces going on from 10 and 13
        assert expected[0, 140].nonzero().flatten().tolist() == [*range(10), 140]
        assert expected[0, 144].nonzero().flatten().tolist() == [*range(13), 144]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_eager_flex_attention_over_the_mask_gives_the_sdpa_loops_outputs():
    """Forward only: flex attention has no CPU backward (the GPU test compares gradients)."""
    pos = torch.tensor([ROWS["documents and shared prefixes"], ROWS["a piece at the very end"]])
    rows, n = pos.shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, 4, n, 16, generator=g)
    k, v = (torch.randn(rows, 2, n, 16, generator=g) for _ in range(2))
    expected, _ = document_sdpa(None, q, k, v, None, scaling=0.3, position_ids=pos)
    got = flex_attention(q, k, v, block_mask=_block_mask(pos, rows, n, pos.device), scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got.transpose(1, 2), expected, rtol=1e-5, atol=1e-5)


def test_a_piece_longer_prefix_than_its_document_is_refused():
    pos = torch.tensor([_positions(R(5), R(8, 12))])  # goes on from 8, but the document has 5 tokens
    with pytest.raises(ValueError, match="goes on from position 8.*has only 5 tokens"):
        _block_mask(pos, 1, 9, pos.device)


def test_flex_where_it_cannot_run_names_the_setting_and_why(monkeypatch):
    with pytest.raises(ValueError, match=r'\[train\] document_attention = "flex": the model is on cpu'):
        attention_kind("flex", torch.device("cpu"))
    with pytest.raises(ValueError, match=r'\[train\] document_attention = "flex"'):
        Trainer(*load_model("tiny-random"), TrainConfig(document_attention="flex"))
    assert attention_kind("auto", torch.device("cpu")) == "sdpa"
    assert attention_kind("auto", torch.device("cpu"), shared_prefixes=False) == "sdpa"
    monkeypatch.setitem(sys.modules, "triton", None)  # a CUDA machine without triton
    with pytest.raises(ValueError, match=r'"flex": it does not import .*triton'):
        attention_kind("flex", torch.device("cuda"))
    assert attention_kind("auto", torch.device("cuda")) == "sdpa"
    with pytest.raises(ValidationError, match="document_attention"):
        TrainConfig(document_attention="fast")
