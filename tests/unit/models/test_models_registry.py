"""load_model: tiny-random, local dirs (Llama / Qwen2 / Qwen3), broken dirs, unknown names.

Run: ``pytest tests/unit/models/test_models_registry.py``.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from opencomposer.models.registry import (
    CACHE_VERSION,
    MARKER,
    ModelLoadError,
    build_cached,
    load_model,
    model_cache_dir,
    smollm2_gguf_path,
    tiny_random_model,
)


def test_tiny_random_shape_and_tokenizer(tiny):
    model, tok = tiny
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == ("llama", 2, 64, 4)
    assert cfg.vocab_size == len(tok) == 49152  # SmolLM2's vocabulary
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    assert not model.training and model.device.type == "cpu"


def test_tiny_random_generates(tiny):
    model, tok = tiny
    ids = tok("hello", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, ids["input_ids"].shape[1] + 5)


def test_tiny_random_weights_are_a_function_of_the_seed(tiny):
    model, tok = tiny
    rebuilt = tiny_random_model(tok).state_dict()
    assert all(torch.equal(t, rebuilt[k]) for k, t in model.state_dict().items())


def test_cache_is_built_once_atomically_and_replaces_stale_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCOMPOSER_CACHE", str(tmp_path))
    stale = model_cache_dir("thing")
    stale.mkdir(parents=True)
    (stale / MARKER).write_text(json.dumps({"cache_version": CACHE_VERSION - 1}))
    builds = []

    def build(out):
        builds.append(out)
        out.mkdir()
        (out / "config.json").write_text("{}")
        return {"from": "test"}

    assert build_cached("thing", build) == stale
    assert build_cached("thing", build) == stale and len(builds) == 1
    assert json.loads((stale / MARKER).read_text()) == {"cache_version": CACHE_VERSION, "source": {"from": "test"}}
    assert builds[0].parent == stale.parent and not builds[0].exists()  # built beside, renamed in

    def broken(out):
        out.mkdir()
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_cached("other", broken)
    assert sorted(p.name for p in stale.parent.iterdir()) == ["thing"]  # nothing half-written


def test_builders_of_one_name_take_turns_and_the_cache_is_built_once(tmp_path, monkeypatch):
    """Ranks of one torchrun all load the model: one builds it, the others wait and read it,
    and none removes the tree another just renamed in."""
    monkeypatch.setenv("OPENCOMPOSER_CACHE", str(tmp_path))
    stale = model_cache_dir("raced")
    stale.mkdir(parents=True)
    (stale / MARKER).write_text(json.dumps({"cache_version": CACHE_VERSION - 1}))  # every racer sees it stale
    builds, start = [], threading.Barrier(4)

    def build(out):
        builds.append(out)
        out.mkdir()
        time.sleep(0.3)  # long enough for every other racer to arrive while it builds
        (out / "config.json").write_text("{}")
        return {"from": "test"}

    def race():
        start.wait()
        return build_cached("raced", build)

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: race(), range(4)))
    assert got == [stale] * 4 and len(builds) == 1
    assert json.loads((stale / MARKER).read_text())["cache_version"] == CACHE_VERSION
    assert sorted(p.name for p in stale.parent.iterdir()) == ["raced"]


def test_a_built_cache_loads_where_no_lock_can_be_made(tiny, monkeypatch):
    """A shared, pre-built cache mounted read-only: the readers' lock file cannot be created there,
    and the model still loads (nothing can rebuild it there either)."""
    from contextlib import contextmanager

    from opencomposer.models import registry

    @contextmanager
    def read_only(name, shared=False):
        raise PermissionError(13, "Read-only file system", f"locks/{name}.lock")
        yield

    monkeypatch.setattr(registry, "held_lock", read_only)
    model, _ = load_model("tiny-random")  # built already (the fixture): no lock needed to build
    assert all(torch.equal(t, tiny[0].state_dict()[k]) for k, t in model.state_dict().items())


def test_dtype_by_name(tiny):
    model, _ = load_model("tiny-random", dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="unknown dtype 'float99'"):
        load_model("tiny-random", dtype="float99")


def test_local_directory_loads(tiny):
    model, tok = load_model(str(model_cache_dir("tiny-random")))
    assert model.config.vocab_size == len(tok)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_local_qwen_directories_load(tmp_path, family):
    tok = AutoTokenizer.from_pretrained(model_cache_dir("tiny-random"))
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    config = config_cls(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
    )
    model_cls(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path))
    assert model.config.model_type == family


def test_broken_directories_name_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json: missing"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        load_model(str(tmp_path))


def test_trainer_checkpoints_load_their_model(tiny, tmp_path):
    """A ``save_checkpoint`` step dir, or the run dir whose ``latest`` names it, loads its
    ``model/``; a LoRA checkpoint (adapter only) and a dangling ``latest`` say what is wrong."""
    from opencomposer.train.checkpoint import save_checkpoint
    from opencomposer.train.config import TrainConfig
    from opencomposer.train.trainer import Trainer

    model, tok = load_model("tiny-random")
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)  # differs from tiny-random, so we know which weights loaded
    step = save_checkpoint(tmp_path / "full", Trainer(model, tok, TrainConfig(bf16=False)), {}, step=2)
    for path in (step, tmp_path / "full"):
        loaded, _ = load_model(str(path))
        assert torch.equal(loaded.model.norm.weight, model.model.norm.weight)
    (tmp_path / "full" / "latest").write_text("step-0009\n")
    with pytest.raises(ModelLoadError, match=r"latest: names 'step-0009', which does not exist"):
        load_model(str(tmp_path / "full"))
    lora, _ = load_model("tiny-random")
    save_checkpoint(tmp_path / "lora", Trainer(lora, tok, TrainConfig(bf16=False, lora=True, lora_r=2)), {}, step=1)
    with pytest.raises(ModelLoadError, match="LoRA checkpoint holds only the adapter"):
        load_model(str(tmp_path / "lora"))
    sharded, _ = load_model("tiny-random")
    save_checkpoint(tmp_path / "sharded", Trainer(sharded, tok, TrainConfig(bf16=False, checkpoint_format="sharded")),
                    {}, step=1)
    with pytest.raises(ModelLoadError, match="a sharded checkpoint .* holds no model directory; export it first \\(.opencomposer export"):
        load_model(str(tmp_path / "sharded"))


def test_unknown_name_explains_what_was_tried():
    with pytest.raises(ModelLoadError) as err:
        load_model("smollm-typo-135m", local_files_only=True)
    msg = str(err.value)
    assert "'smollm-typo-135m'" in msg and "hub id" in msg
    assert "smollm2-135m" in msg and "tiny-random" in msg and "local" in msg


def test_missing_path_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"))


def test_embedded_gguf_is_found():
    path = smollm2_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
