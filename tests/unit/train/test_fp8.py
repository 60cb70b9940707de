"""FP8 linear layers (``train/fp8.py``, ``[train] fp8``) on the CPU, where ``torch._scaled_mm`` runs the
same float8 products exactly (fp32 sums): scales from the amax, the three GEMMs equal to products of the
cast operands, forward and gradients within float8's rounding of the plain linear layer's, the shape
fallback, what ``convert_to_float8`` leaves alone, the trainer's refusal without FP8 hardware, and a few
optimizer steps of tiny-random tracking the bf16 run.

Tolerances: e4m3 keeps 3 mantissa bits, so rounding a value m * 2^e (m in [1, 2)) errs by up to 2^(e-4),
uniformly: a relative RMS of 2^-3 / (sqrt(12) m), about 2.6% averaged over m. A product sums many
independently rounded terms, so its relative error is about that of one term: sqrt(2) x 2.6% ~ 3.7% with
both operands in e4m3 (forward; rowwise gradients), and sqrt(5.2^2 + 2.6^2) ~ 5.8% with an e5m2 gradient
(2 mantissa bits) against an e4m3 operand (tensorwise gradients). The bounds below are 1.4x those, and a
floor of 1% shows the GEMMs really ran in float8.

Run: ``pytest tests/unit/train/test_fp8.py``.
"""

from __future__ import annotations

import pytest
import torch

from opencomposer.bench.train import dense_samples, rl_like_samples
from opencomposer.config import ConfigError, validate
from opencomposer.train import TrainConfig, Trainer
from opencomposer.train.config import PretrainRunConfig
from opencomposer.train.fp8 import (ALLOW_CPU_ENV, E4M3, E5M2, Float8Linear, convert_to_float8, fp8_unsupported,
                                    quantize)
from opencomposer.train.loss import LossConfig
from opencomposer.train.trainer import merged_lora_state

FORWARD_BOUND = 0.05  # both operands e4m3: ~3.7% expected
GRAD_BOUND = {"tensorwise": 0.08, "rowwise": 0.05}  # e5m2 gradient ~5.8%; e4m3 ~3.7%


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    monkeypatch.setenv(ALLOW_CPU_ENV, "1")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _deq(q: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    return q.float() * inv


def _run(layer: torch.nn.Module, x: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Output and the gradients of x, weight and bias for the loss sum(y * up)."""
    x = x.detach().requires_grad_(True)
    y = layer(x)
    grads = torch.autograd.grad((y.float() * up).sum(), (x, layer.weight, layer.bias))
    return (y.detach(), *grads)


def test_scales_are_powers_of_two_from_the_amax():
    t = torch.tensor([[0.5, -3.0, 0.25], [0.01, 0.02, -0.04]])
    q, inv = quantize(t, E4M3)
    assert q.dtype == E4M3 and inv.dtype == torch.float32 and inv.numel() == 1
    assert float(inv) == 1 / 128  # 448 / 3 = 149.3 -> 2^7: 3.0 lands on 384, in [224, 448]
    assert float(q.float().abs().max()) == 384.0
    q, inv = quantize(t, E4M3, dim=1)  # one scale a row, over its columns
    assert inv.shape == (2, 1) and inv.flatten().tolist() == [1 / 128, 1 / 8192]  # 448 / 0.04 = 11200 -> 2^13
    assert torch.allclose(_deq(q, inv), t, rtol=2 ** -4)
    q, inv = quantize(t, E5M2, dim=0)  # one a column, over its rows; e5m2's largest is 57344
    assert inv.shape == (1, 3) and float(inv[0, 1]) == 1 / 16384
    q, inv = quantize(torch.zeros(4, 4), E4M3)
    assert torch.isfinite(inv) and not q.float().any()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_three_gemms_are_the_products_of_the_cast_operands(recipe):
    """Forward, grad input and grad weight equal fp32 products of the dequantised float8 operands, each
    cast with its recipe's scales along the GEMM's reduction dimension; 37 tokens (not a multiple of 16:
    the grad-weight GEMM pads them)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96)
    layer = Float8Linear.from_linear(lin, recipe)
    x, up = torch.randn(37, 64), torch.randn(37, 96)
    y, gx, gw, gb = _run(layer, x, up)
    rowwise = recipe == "rowwise"
    w = lin.weight.detach()
    written = (lambda t: t.bfloat16().float()) if rowwise else (lambda t: t)  # the rowwise kernels write bf16
    want_y = _deq(*quantize(x, E4M3, 1 if rowwise else None)) @ _deq(*quantize(w, E4M3, 1 if rowwise else None)).t()
    torch.testing.assert_close(y, written(want_y) + lin.bias.detach(), rtol=1e-5, atol=1e-5)
    g_dtype = E4M3 if rowwise else E5M2
    want_gx = _deq(*quantize(up, g_dtype, 1 if rowwise else None)) @ _deq(*quantize(w, E4M3, 0 if rowwise else None))
    want_gw = _deq(*quantize(up, g_dtype, 0 if rowwise else None)).t() @ _deq(*quantize(x, E4M3, 0 if rowwise else None))
    want_gx, want_gw = written(want_gx), written(want_gw)
    torch.testing.assert_close(gx, want_gx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, want_gw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb, up.sum(0))  # the bias's gradient stays in high precision


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_and_gradients_are_the_linear_layers_to_float8_rounding(recipe, dtype):
    torch.manual_seed(1)
    lin = torch.nn.Linear(128, 64)
    x, up = torch.randn(2, 50, 128, dtype=dtype), torch.randn(2, 50, 64)
    want = _run(lin, x.float(), up)
    got = _run(Float8Linear.from_linear(lin, recipe), x, up)
    assert got[0].dtype == got[1].dtype == dtype and got[2].dtype == got[3].dtype == torch.float32
    for name, g, w, bound in zip(("y", "grad x", "grad weight"), got, want,
                                 (FORWARD_BOUND, GRAD_BOUND[recipe], GRAD_BOUND[recipe])):
        assert 0.01 < _rel(g, w) < bound, (name, _rel(g, w))
    assert _rel(got[3], want[3]) < 0.01  # bias


def test_under_autocast_the_output_is_autocasts_dtype_and_gradients_the_masters():
    lin = Float8Linear(64, 32)
    x = torch.randn(5, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16  # as F.linear's under autocast
    y.float().sum().backward()
    assert x.grad.dtype == lin.weight.grad.dtype == lin.bias.grad.dtype == torch.float32


def test_a_layer_whose_shape_does_not_fit_stays_an_nn_linear():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 40))
    report = convert_to_float8(model, "tensorwise")
    assert isinstance(model[0], Float8Linear) and type(model[2]) is torch.nn.Linear
    assert report.converted == ["0"] and "40x32" in report.skipped["2"] and "multiples of 16" in report.skipped["2"]
    assert "1 left as they were: 2: shape 40x32" in report.summary()
    with pytest.raises(ValueError, match="multiples of 16"):
        Float8Linear(40, 64)
    with pytest.raises(ValueError, match="recipe 'mxfp8'"):
        convert_to_float8(model, "mxfp8")


def test_conversion_keeps_the_parameters_and_leaves_the_head_and_embeddings(tiny):
    model, _ = tiny
    before = model.state_dict()
    weights = {name: p for name, p in model.named_parameters()}
    report = convert_to_float8(model, "rowwise")
    assert len(report.converted) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert set(report.skipped) == {"lm_head"} and "output layer" in report.skipped["lm_head"]
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.embed_tokens) is torch.nn.Embedding
    assert isinstance(model.model.layers[1].mlp.down_proj, Float8Linear)
    assert model.model.layers[1].mlp.down_proj.recipe == "rowwise"
    assert all(p is weights[name] for name, p in model.named_parameters())  # the optimizer's own tensors
    assert model.state_dict().keys() == before.keys()  # checkpoints and exports see plain names
    # without skipping the head: its weight is the embedding's (tied), still left alone
    report2 = convert_to_float8(model, "rowwise", skip_head=False)
    assert report2.converted == [] and "tied" in report2.skipped["lm_head"]


def test_the_trainer_refuses_fp8_without_fp8_hardware(tiny, monkeypatch):
    monkeypatch.delenv(ALLOW_CPU_ENV, raising=False)
    assert "compute capability 8.9" in fp8_unsupported("cpu")
    with pytest.raises(ValueError, match=r"train.fp8 = 'tensorwise': FP8 GEMMs need a CUDA GPU of compute "
                                         r"capability 8.9 or newer; the model is on cpu .*OPENCOMPOSER_FP8_ALLOW_CPU"):
        Trainer(*tiny, TrainConfig(fp8="tensorwise"))


def test_a_bad_fp8_value_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"x.toml: key 'train.fp8': input should be 'off', 'tensorwise' or "
                                          r"'rowwise', got 'e4m3'"):
        validate({"train": {"fp8": "e4m3"}}, PretrainRunConfig, "x.toml")
    assert TrainConfig().fp8 == "off"


def test_a_few_steps_track_the_bf16_runs_losses(fp8_on_cpu):
    """Six SFT steps of tiny-random on the same windows (bf16 autocast, activation checkpointing: the
    trainer's CPU path): each recipe's losses within 1% of the bf16 run's, and falling."""
    from opencomposer.models import load_model

    losses = {}
    for fp8 in ("off", "tensorwise", "rowwise"):
        model, tok = load_model("tiny-random")
        trainer = Trainer(model, tok, TrainConfig(lr=3e-3, fp8=fp8, micro_batch_tokens=1024))
        assert (trainer.fp8 is None) == (fp8 == "off")
        samples = dense_samples(1024, 2000, seed=0, seq_len=256)
        losses[fp8] = [trainer.sft_step(samples)["loss"] for _ in range(6)]
    for fp8 in ("tensorwise", "rowwise"):
        assert max(abs(a - b) / b for a, b in zip(losses[fp8], losses["off"])) < 0.01, losses
        assert losses[fp8][-1] < losses[fp8][0] - 0.5, losses


def test_lora_trains_its_adapters_over_float8_base_layers(tiny, fp8_on_cpu):
    """LoRA: the frozen base layers run in float8, the adapters stay as they are; an RL step with a KL
    term (the reference: the adapters disabled) runs, and the merged weights keep the plain names."""
    trainer = Trainer(*tiny, TrainConfig(lr=1e-3, fp8="tensorwise", lora=True))
    assert len(trainer.fp8.converted) == 14 and all(n.endswith(".base_layer") for n in trainer.fp8.converted)
    adapters = [n for n in trainer.fp8.skipped if ".lora_" in n]
    assert len(adapters) == 28 and all("lora" in trainer.fp8.skipped[n] for n in adapters)
    samples = rl_like_samples(1500, 2000, seed=0, scale=0.2, k=4)
    m = trainer.rl_step(samples, LossConfig(kl_coef=0.1), normalizer=1000.0)
    assert m["version"] == 1.0 and m["grad_norm"] > 0
    assert "model.layers.0.self_attn.q_proj.weight" in merged_lora_state(trainer.model)


def test_every_gemm_meets_the_cuda_kernels_contract(monkeypatch):
    """What CUDA's ``_scaled_mm`` checks and the CPU's does not (torch/_meta_registrations.py, Blas.cpp):
    the first operand row-major, the second column-major, inner and output dimensions multiples of 16,
    fp32 scales (one, or contiguous (m, 1) and (1, n)), never two e5m2 operands; rowwise: e4m3 operands
    and a bf16 output. Checked on every call of a forward and backward with a strided input and 37 tokens."""
    real, calls = torch._scaled_mm, []

    def checked(a, b, scale_a, scale_b, out_dtype=None, use_fast_accum=False, **kw):
        (m, k), n = a.shape, b.shape[1]
        assert a.stride()[0] > a.stride()[1] == 1 and b.stride()[1] > b.stride()[0] == 1, (a.stride(), b.stride())
        assert k % 16 == 0 and b.shape[0] == k and n % 16 == 0, (a.shape, b.shape)
        assert scale_a.dtype == scale_b.dtype == torch.float32 and not (a.dtype == b.dtype == E5M2)
        rowwise = scale_a.numel() > 1 or scale_b.numel() > 1
        if rowwise:
            assert scale_a.shape == (m, 1) and scale_b.shape == (1, n)
            assert scale_a.is_contiguous() and scale_b.is_contiguous()
            assert a.dtype == b.dtype == E4M3 and out_dtype == torch.bfloat16
        calls.append((m, k, n, rowwise))
        return real(a, b, scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", checked)
    for recipe in ("tensorwise", "rowwise"):
        layer = Float8Linear(64, 32, recipe=recipe)
        x = torch.randn(64, 37).t().requires_grad_(True)  # (37, 64), column-major
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        (y.float() * torch.randn(32, 37).t()).sum().backward()  # a strided output gradient too
    assert calls == [(37, 64, 32, False), (37, 32, 64, False), (32, 48, 64, False),
                     (37, 64, 32, True), (37, 32, 64, True), (32, 48, 64, True)]


def test_an_fp8_runs_checkpoint_exports_where_fp8_does_not_run(tmp_path, tiny, monkeypatch):
    """The float8 layers keep nn.Linear's state-dict keys, and exporting a checkpoint (no training GEMM)
    ignores ``fp8``: a GPU run's checkpoint exports on a CPU, its weights the trainer's."""
    from opencomposer.models import load_model
    from opencomposer.train.checkpoint import save_checkpoint
    from opencomposer.train.export import export_checkpoint

    monkeypatch.setenv(ALLOW_CPU_ENV, "1")
    trainer = Trainer(*tiny, TrainConfig(lr=1e-2, fp8="rowwise"))
    trainer.sft_step(dense_samples(256, 2000, seed=0, seq_len=128))
    save_checkpoint(tmp_path / "ckpt", trainer, {}, step=1)
    monkeypatch.delenv(ALLOW_CPU_ENV)
    exported, _ = load_model(export_checkpoint(tmp_path / "ckpt", tmp_path / "model")["exported"])
    assert not any(isinstance(m, Float8Linear) for m in exported.modules())
    mine = trainer.model.state_dict()
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, mine[name])
