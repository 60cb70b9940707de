import pytest

from textkit.numbers import clamp, mean


def test_clamp():
    assert clamp(5, 0, 3) == 3
    assert clamp(-1, 0, 3) == 0
    assert clamp(2, 0, 3) == 2
    with pytest.raises(ValueError):
        clamp(1, 3, 0)


def test_mean():
    assert mean([1, 2, 3, 6]) == 3
    with pytest.raises(ValueError):
        mean([])
