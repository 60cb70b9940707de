"""CUDA-graph capture for the engine, on a stream of the current device.

``torch.cuda.graph(g)`` without a stream captures on one side stream kept for the whole process,
made on whichever device was current the first time: an engine on ``cuda:1`` built after one on
``cuda:0`` (``[rollout] engine_devices``, a trainer beside it) would record its kernels on a
stream of the wrong device and capture an empty graph. ``capture(g)`` keeps one capture stream
per device and uses the current device's (the engine makes its own device current while it
builds and steps: ``Engine._on_device``).

Test: ``tests/gpu/test_engine_cuda.py`` (an engine on the second GPU with the first current).
"""

from __future__ import annotations

import torch

_streams: dict[int, torch.cuda.Stream] = {}


def capture(graph: torch.cuda.CUDAGraph, pool=None) -> torch.cuda.graph:
    """``torch.cuda.graph(graph, pool)`` on the current device's own capture stream."""
    device = torch.cuda.current_device()
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device=device)
    return torch.cuda.graph(graph, pool=pool, stream=stream)
