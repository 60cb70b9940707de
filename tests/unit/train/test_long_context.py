"""Long-context extension (``train/long_context.py``, YaRN): the frequencies and table scale the
engine computes against Hugging Face's for the same settings, the extension of a model's config
and rotary module, its export, and ``pretrain --context-factor`` measured before and after.
(The engine's greedy outputs on an extended model: ``tests/unit/inference/test_model_parity.py``.)"""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from opencomposer.inference.models.decoder_config import DecoderConfig, rope_attention_scale, rope_inv_freq
from opencomposer.models import load_model
from opencomposer.train.long_context import extend_context, native_context
from opencomposer.train.pretrain import run_pretrain

STDLIB = Path(string.__file__).parent


@pytest.mark.parametrize("yarn", [
    {"factor": 4.0},
    {"factor": 2.0, "beta_fast": 16, "beta_slow": 2},
    {"factor": 8.0, "truncate": False},
    {"factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707},
    {"factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"factor": 3.0, "attention_factor": 1.25},
])
@pytest.mark.parametrize("theta, head_dim", [(10000.0, 64), (100000.0, 128), (1e6, 16)])
def test_yarn_frequencies_and_scale_match_hugging_face(yarn, theta, head_dim):
    native = 2048
    rope = {"rope_type": "yarn", "rope_theta": theta, "original_max_position_embeddings": native, **yarn}
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                         intermediate_size=64, num_hidden_layers=1,
                         max_position_embeddings=int(native * yarn["factor"]), rope_parameters=rope)
    want_inv, want_scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = DecoderConfig.from_hf(config)
    assert torch.allclose(rope_inv_freq(ours), want_inv.float(), rtol=1e-6, atol=0)
    assert rope_attention_scale(ours) == pytest.approx(want_scale, rel=1e-9)


def test_extend_context_rescales_the_config_and_the_rotary_module(tmp_path):
    model, tok = load_model("tiny-random")
    ids = torch.tensor([list(range(3, 300))])
    with torch.no_grad():
        before = model(ids).logits
    info = extend_context(model, 4.0)
    assert info["native_context"] == 2048 and info["context"] == 8192 == model.config.max_position_embeddings
    assert info["rope"]["rope_type"] == "yarn" and native_context(model.config) == 2048
    rotary = model.model.rotary_emb
    assert rotary.rope_type == "yarn" and rotary.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    with torch.no_grad():
        after = model(ids).logits
    assert not torch.allclose(before, after)  # the forward pass uses the new tables
    # the engine reads the same scaling from the config: the same frequencies as the model's module
    ours = DecoderConfig.from_hf(model.config)
    assert torch.equal(rope_inv_freq(ours), rotary.inv_freq.float())
    # exported and loaded again: still extended, the same outputs
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    again, _ = load_model(str(tmp_path / "m"))
    assert again.config.max_position_embeddings == 8192 and again.model.rotary_emb.rope_type == "yarn"
    with torch.no_grad():
        assert torch.allclose(again(ids).logits, after, atol=1e-5)
    # refused: no extension, or one on top of another
    with pytest.raises(ValueError, match=r"context_factor=1: a context extension needs a factor above 1"):
        extend_context(model, 1)
    with pytest.raises(ValueError, match=r"its RoPE is already scaled \(rope_type 'yarn'\)"):
        extend_context(again, 2.0)


@pytest.fixture
def short_model(tmp_path) -> str:
    """tiny-random saved with a native context of 256 tokens (so 4x is a 1,024-token window)."""
    model, tok = load_model("tiny-random")
    model.config.max_position_embeddings = 256
    model.save_pretrained(tmp_path / "short")
    tok.save_pretrained(tmp_path / "short")
    return str(tmp_path / "short")


def test_pretrain_extends_the_context_and_measures_each_length(short_model, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    for name in ("string.py", "textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py",
                 "json/decoder.py", "json/encoder.py", "calendar.py", "argparse.py"):
        shutil.copy(STDLIB / name, code / name.replace("/", "_"))
    with pytest.raises(ValueError, match=r"seq_len=1024 is longer than .*context \(256 tokens"):
        run_pretrain([code], short_model, tmp_path / "refused", steps=1, seq_len=1024, progress=False)
    res = run_pretrain([code], short_model, tmp_path / "run", steps=16, seq_len=1024, batch_size=2, lr=3e-3, warmup=2,
                       eval_every=0, save_every=0, held_out=0.25, eval_windows=4, progress=False,
                       context_factor=4.0, eval_lengths=[256, 1024])
    assert res["context"] == {"native_context": 256, "context": 1024} and res["rope"]["factor"] == 4.0
    native, extended, after = res["evals"]
    assert native["native_rope"] is True and native["step"] == extended["step"] == 0 and after["step"] == 16
    assert set(native) >= {"held_out", "held_out@256"} and "held_out@1024" not in native  # seq_len is "held_out"
    assert native["held_out"]["windows"] >= 1 and native["held_out@256"]["windows"] >= 1
    # the stage lowers held-out loss at the native length and at 4x it
    for name in ("held_out", "held_out@256"):
        assert after[name]["loss"] < extended[name]["loss"] - 0.5, (name, res["evals"])
    exported, _ = load_model(res["model_dir"])
    assert exported.config.max_position_embeddings == 1024 and exported.config.rope_parameters["rope_type"] == "yarn"
    # resumed with another factor: refused, naming it
    with pytest.raises(Exception, match=r"context_factor=4.0, this run has context_factor=8.0"):
        run_pretrain([code], short_model, tmp_path / "run", steps=20, seq_len=1024, batch_size=2, held_out=0.25,
                     progress=False, context_factor=8.0)


def test_the_command_prints_each_length_before_and_after(short_model, tmp_path):
    """``opencomposer pretrain --context-factor``: the native-RoPE measurement is said as such, each
    measured length printed before -> after, and the last line is the result's JSON."""
    from typer.testing import CliRunner

    from opencomposer.cli import app

    code = tmp_path / "code"
    code.mkdir()
    for name in ("string.py", "textwrap.py", "shlex.py", "argparse.py", "calendar.py"):
        shutil.copy(STDLIB / name, code / name)
    cfg = tmp_path / "p.toml"
    cfg.write_text(f"[pretrain]\ndata = ['{code}']\nmodel = '{short_model}'\nheld_out = 0.4\neval_windows = 2\n")
    res = CliRunner().invoke(app, ["pretrain", "--config", str(cfg), "--steps", "2", "--seq-len", "1024",
                                   "--batch-size", "1", "--out", str(tmp_path / "o"), "--eval-every", "0",
                                   "--context-factor", "4", "--eval-length", "256", "--eval-length", "1024"])
    assert res.exit_code == 0, res.output
    assert "before: the model as it came (its native RoPE)" in res.stderr
    assert "held_out: loss" in res.stderr and "held_out@256: loss" in res.stderr
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert last["rope"]["factor"] == 4.0 and last["before"]["native_rope"] is True
