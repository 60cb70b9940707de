"""What the benchmarks share: the random models they run, their timing and their report line.

``SHAPES`` and ``random_model`` (a randomly initialised Hugging Face model of a named size),
timing (``_sync``, the copy ``bandwidth``, ``time_ms`` per call), random ``_prompts``, and
the report (``_figures``, ``_r4``; ``emit`` prints the last JSON line). The engine bench
(``engine.py``) and the others (``sync.py``, ``spec.py``, ``moe.py``, ``fsdp.py``,
``checkpoint.py``, ``benchmarks/``) build on them.

Test: ``pytest tests/bench/test_engine_bench.py -q``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                         "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen2.5-1.5b": {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                         "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True},
    # the embedded default model's shape (a Llama): the CPU figures in benchmarks/RESULTS.md
    "smollm2-135m": {"family": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
                     "tie_word_embeddings": True, "rope_theta": 1e5, "rms_norm_eps": 1e-5},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128, "vocab_size": 512, "tie_word_embeddings": True},
}


def random_model(shape: str, device: str, dtype: torch.dtype, seed: int = 0, **overrides: Any):
    """A randomly initialised Hugging Face model of a ``SHAPES`` entry (Qwen2 unless it names
    another family); ``overrides`` replace config keys (e.g. ``num_hidden_layers=1`` where only
    the heads and vocabulary matter)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {sorted(SHAPES)}")
    spec = {"rope_theta": 1e6, "rms_norm_eps": 1e-6, **SHAPES[shape], **overrides}
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "llama": (LlamaConfig, LlamaForCausalLM)}[spec.pop("family", "qwen2")]
    cfg = config_cls(**spec, max_position_embeddings=32768, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(cfg).to(dtype)
    return model.eval()


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bandwidth(device: str) -> float:
    """Bytes/s of a large device copy (bytes read + bytes written)."""
    n = (1 << 30) if torch.device(device).type == "cuda" else (1 << 27)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    _sync(device)
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    _sync(device)
    return 2 * n * reps / (time.perf_counter() - t)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def time_ms(fn, device: torch.device, reps: int = 5) -> float:
    """Milliseconds per call of ``fn``: from a CUDA graph on CUDA, else the median of ``reps``."""
    if device.type == "cuda":
        from opencomposer.inference.engine.batch1_plan import graph_ms

        return graph_ms(fn)
    import statistics

    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def emit(result: dict[str, Any], out: str | None) -> None:
    """A benchmark's last line: ``result`` as one JSON line, also written atomically to ``out``."""
    line = json.dumps(result)
    if out:
        from pathlib import Path

        from opencomposer.paths import atomic_write_text

        atomic_write_text(Path(out), line + "\n")
    print(line)


def _r4(v):
    return v if isinstance(v, bool) else round(v, 4)


def _figures(d: dict[str, float]) -> dict[str, float]:
    """Four significant digits: rounding to decimal places turned a small fraction of the
    roofline (a CPU run: 28 tok/s against a roofline of ~10^5) into 0."""
    return {k: float(f"{v:.4g}") for k, v in d.items()}
