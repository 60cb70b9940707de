"""Long-context extension: a model's context times ``factor`` by YaRN RoPE scaling (Peng et al.
2023, arXiv:2309.00071), written into its config, so the model trains on, exports with and is
served at the longer context (the engine reads the same scaling: ``inference/models/
decoder_config.py``).

    info = extend_context(model, 4.0)     # SmolLM2-135M: 8,192 -> 32,768 tokens
    # then train on long windows: opencomposer pretrain ... --context-factor 4 --seq-len 32768

The config gets ``rope_type = "yarn"``, ``factor``, ``original_max_position_embeddings`` (the
native context) and a ``max_position_embeddings`` of ``factor`` times it; the model's rotary
module is rebuilt from it in place (its buffers are not parameters, so a model already wrapped
by a trainer or FSDP2 takes it as well). A model whose rotary embedding is already scaled
(Llama 3.x, an earlier extension) is refused, naming its ``rope_type``: scalings do not compose.

``[pretrain] context_factor`` (``train/pretrain.py``) applies it before the first step, measures
held-out loss at ``eval_lengths`` with the native and the extended RoPE, then trains.

Test: ``pytest tests/unit/train/test_long_context.py``.
"""

from __future__ import annotations

from typing import Any


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE settings as one dict (transformers 5: ``rope_parameters``; 4: ``rope_scaling``
    and ``rope_theta``)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


def native_context(config: Any) -> int:
    """The context a model was pretrained for: the extension's original, or its own."""
    rope = rope_parameters(config)
    return int(rope.get("original_max_position_embeddings") or config.max_position_embeddings)


def extend_context(model: Any, factor: float) -> dict[str, Any]:
    """Scale ``model``'s RoPE by YaRN so its context is ``factor`` times the native one (module
    docstring); returns what changed."""
    if not factor > 1:
        raise ValueError(f"context_factor={factor}: a context extension needs a factor above 1")
    config = model.config
    rope = rope_parameters(config)
    if rope["rope_type"] not in ("default", None):
        raise ValueError(f"{getattr(config, 'name_or_path', 'the model')}: its RoPE is already scaled "
                         f"(rope_type {rope['rope_type']!r}); a YaRN extension would not compose with it")
    native = int(config.max_position_embeddings)
    context = int(round(native * factor))
    rope.update({"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": native})
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = rope
    else:  # transformers 4.x
        config.rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    config.max_position_embeddings = context
    _rebuild_rotary(model)
    return {"native_context": native, "context": context, "rope": rope}


def _rebuild_rotary(model: Any) -> None:
    """Each rotary module of ``model`` made again from its (changed) config, into the old one's
    buffers and attributes, so references held elsewhere see the new tables."""
    found = 0
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq"):
            fresh = type(module)(config=model.config)
            for name, buf in fresh.named_buffers(recurse=False):
                old = getattr(module, name)
                old.data = buf.to(device=old.device, dtype=old.dtype)
            for name, value in vars(fresh).items():  # rope_type, attention_scaling, lengths, config...
                if not name.startswith("_") and name != "training":
                    setattr(module, name, value)
            found += 1
    if not found:
        raise ValueError(f"{type(model).__name__}: no rotary embedding module found to rescale")
