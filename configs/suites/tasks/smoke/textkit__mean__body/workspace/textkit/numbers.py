"""Small number helpers."""


def clamp(x, lo, hi):
    """``x`` limited to the closed interval [lo, hi]."""
    if lo > hi:
        raise ValueError(f"empty interval [{lo}, {hi}]")
    return max(lo, min(x, hi))


def mean(xs):
    """Arithmetic mean of a non-empty sequence."""
    raise NotImplementedError
