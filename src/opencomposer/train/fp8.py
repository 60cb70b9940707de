"""FP8 training of linear layers: ``Float8Linear`` computes ``y = x W^T (+ b)`` with both GEMM operands
in float8, in the forward and in both backward GEMMs (``[train] fp8``, issue 32).

    report = convert_to_float8(model, recipe="tensorwise")   # what the trainer does with fp8 = "tensorwise"
    report.converted            # ["model.layers.0.self_attn.q_proj", ...]
    report.skipped              # {"lm_head": "the output layer ...", ...}: these stay in bf16/fp32

Each of the three GEMMs (forward ``x W^T``; grad input ``g W``; grad weight ``g^T x``) quantises its two
operands on the fly and runs ``torch._scaled_mm``, which multiplies float8 values, accumulates in fp32
and applies the two dequantisation scales to the result:

* forward operands (activations ``x``, weights ``W``) in e4m3 (3 mantissa bits, largest 448);
* the output gradient ``g`` in e5m2 with ``tensorwise`` scales (2 mantissa bits, largest 57,344: one
  scale must span a whole gradient tensor, whose values spread over more binades than activations'),
  in e4m3 with ``rowwise`` scales (a scale per row already covers the spread, so precision wins);
* scales are dynamic, from the amax of the tensor being cast (no history): ``tensorwise`` one per
  tensor; ``rowwise`` one per row of each operand along the GEMM's reduction dimension, so every GEMM
  re-casts its operands from high precision with its own scales. A scale is rounded down to a power of
  two, so dequantising is exact and the largest value lands in [fmax/2, fmax].

Master weights keep their dtype (fp32 under the trainer, bf16 in FSDP2's gathered copy) and receive a
gradient in it; the output has the input's dtype, or autocast's where autocast is on (as ``F.linear``).
The bias and its gradient stay in high precision. Rowwise GEMMs write bf16 (the rowwise kernels' only
output dtype), cast to the wanted dtype after. The forward GEMM accumulates with Hopper's fast FP8
accumulation (``use_fast_accum``), the two gradient GEMMs without it (small gradient contributions
would be lost). ``tensorwise`` saves the activations for backward in float8 (1 byte an element instead
of 2) and the weight's float8 copy (backward's cast would be the same: one cast of W a micro-batch, not
two), ``rowwise`` saves both as given (they are re-cast along another dimension there).

``_scaled_mm`` wants both weight dimensions to be multiples of 16 (CUDA's cuBLASLt / CUTLASS kernels);
a layer whose shape does not fit stays a plain ``nn.Linear`` and is listed in ``report.skipped`` with
the reason. The token dimension needs no such care: the grad-weight GEMM, which reduces over tokens,
pads them with zero rows to a multiple of 16.

Skipped by default: the output layer (its error would land on every token's log-prob, and it is tied to
the embeddings in small models), embeddings (not linear layers), LoRA adapters (``lora_A`` / ``lora_B``:
rank-16 GEMMs gain nothing and the adapters are what LoRA trains; their frozen base layers are converted)
and MoE routers (``*.mlp.gate``: their scores choose the experts).

Devices: FP8 GEMMs need CUDA compute capability 8.9 or newer (Ada, Hopper, Blackwell); ``fp8_unsupported``
says why not elsewhere. ``torch._scaled_mm`` also runs on the CPU (slowly, exactly: float8 products
summed in fp32), which the CPU tests use: set ``OPENCOMPOSER_FP8_ALLOW_CPU=1`` to let the trainer take
the FP8 path on a CPU. It pays only where the GEMMs are large (hidden sizes in the thousands and many
tokens a micro-batch); the casts are extra memory passes that small layers do not earn back.

Test: ``pytest tests/unit/train/test_fp8.py`` (CPU); ``tests/gpu/test_fp8_cuda.py`` (loss parity on CUDA).
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

RECIPES = ("tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ALLOW_CPU_ENV = "OPENCOMPOSER_FP8_ALLOW_CPU"  # "1": FP8 GEMMs on the CPU (tests; slow)
DEFAULT_SKIP = ("*lora_*", "*.mlp.gate")  # LoRA adapters; MoE routers (their scores pick the experts)
MIN_CAPABILITY = (8, 9)
_AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale


def fp8_unsupported(device: torch.device | str) -> str | None:
    """Why FP8 GEMMs cannot run on ``device``, or None where they can (CUDA compute capability 8.9+;
    a CPU where ``OPENCOMPOSER_FP8_ALLOW_CPU=1``)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        cap = torch.cuda.get_device_capability(device)
        if cap < MIN_CAPABILITY:
            return (f"{torch.cuda.get_device_name(device)} has compute capability {cap[0]}.{cap[1]}; FP8 GEMMs need "
                    "8.9 or newer (Ada, Hopper, Blackwell)")
        return None
    if device.type == "cpu" and os.environ.get(ALLOW_CPU_ENV) == "1":
        return None
    return (f"FP8 GEMMs need a CUDA GPU of compute capability 8.9 or newer; the model is on {device.type} "
            f"(on a CPU, {ALLOW_CPU_ENV}=1 runs them there for tests, slowly)")


def fits(linear: torch.nn.Linear) -> bool:
    """Whether ``_scaled_mm`` takes this layer's weight: both dimensions multiples of 16."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in float8 ``dtype`` and the fp32 scale that undoes the cast (``t ~ q.float() * inv``).
    ``dim=None``: one scale for the tensor; ``dim=d``: one per slice, from the amax over ``d`` (kept as
    a dimension of size 1). Scales are powers of two (exact to undo), from the amax: the largest value
    lands in [fmax/2, fmax]."""
    fmax = torch.finfo(dtype).max
    # the inf-norm is max |t| in one pass, without an |t| copy
    amax = torch.linalg.vector_norm(t, ord=float("inf"), dim=dim, keepdim=dim is not None)
    scale = torch.exp2(torch.floor(torch.log2(fmax / amax.float().clamp(min=_AMAX_FLOOR))))
    # a power of two multiplies bf16 and fp32 exactly in their own dtype (no fp32 copy of a bf16 tensor), and
    # scale <= fmax / amax, so |t * scale| <= fmax: no clamp (a pass over the tensor) is needed before the cast
    work = t if t.dtype in (torch.float32, torch.bfloat16) else t.float()
    q = (work * scale.to(work.dtype)).to(dtype)
    return q, scale.reciprocal()


def _column_major(q: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column by column (``_scaled_mm``'s second operand)."""
    return q.t().contiguous().t()


def _pad_rows(q: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """Zero rows appended to a float8 matrix up to a multiple of ``multiple`` rows (through a uint8
    view: a zero byte is +0.0 in both float8 formats, and not every device fills float8 tensors)."""
    extra = -q.shape[0] % multiple
    if not extra:
        return q
    raw = q.view(torch.uint8)
    return torch.cat([raw, raw.new_zeros(extra, q.shape[1])]).view(q.dtype)


def _scaled_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype,
               rowwise: bool, fast: bool = False) -> torch.Tensor:
    """``a @ b`` of float8 ``a`` (m, k, row-major) and ``b`` (k, n, column-major), their scales applied.
    Rowwise: ``a_inv`` (m, 1) and ``b_inv`` (1, n); the rowwise kernels write bf16 only, cast after."""
    out = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=torch.bfloat16 if rowwise else out_dtype,
                           use_fast_accum=fast)
    return out.to(out_dtype)


class _Float8Matmul(torch.autograd.Function):
    """``x @ W^T`` for 2-D ``x`` (tokens, in) and ``W`` (out, in): three float8 GEMMs (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, recipe: str, out_dtype: torch.dtype) -> torch.Tensor:
        rowwise = recipe == "rowwise"
        x_q, x_inv = quantize(x, E4M3, 1 if rowwise else None)
        w_q, w_inv = quantize(weight, E4M3, 1 if rowwise else None)
        x_q, w_q = x_q.contiguous(), w_q.contiguous()  # row-major, whatever the strides of x
        out = _scaled_mm(x_q, x_inv, w_q.t(), w_inv.reshape(1, -1) if rowwise else w_inv, out_dtype, rowwise, fast=True)
        ctx.recipe, ctx.x_dtype, ctx.w_dtype = recipe, x.dtype, weight.dtype
        # x only for the weight's gradient (rowwise re-casts it with scales over tokens); W only for x's
        # (tensorwise: its float8 copy, the same cast backward would make again; rowwise re-casts over out)
        keep_x, keep_w = ctx.needs_input_grad[1], ctx.needs_input_grad[0]
        cast_x, cast_w = keep_x and not rowwise, keep_w and not rowwise
        ctx.save_for_backward(x if rowwise and keep_x else None, x_q if cast_x else None, x_inv if cast_x else None,
                              weight if rowwise and keep_w else None, w_q if cast_w else None,
                              w_inv if cast_w else None)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        rowwise = ctx.recipe == "rowwise"
        x, x_q, x_inv, weight, w_q, w_inv = ctx.saved_tensors
        grad_x = grad_w = None
        with torch.autocast(grad.device.type, enabled=False):
            if not rowwise:  # one cast of the gradient serves both GEMMs
                g_q, g_inv = quantize(grad, E5M2)
            if ctx.needs_input_grad[0]:  # (tokens, out) @ (out, in): reduces over out
                if rowwise:
                    g_q, g_inv = quantize(grad, E4M3, 1)
                    w_q, w_inv = quantize(weight, E4M3, 0)
                grad_x = _scaled_mm(g_q.contiguous(), g_inv, _column_major(w_q), w_inv, ctx.x_dtype, rowwise)
            if ctx.needs_input_grad[1]:  # (out, tokens) @ (tokens, in): reduces over tokens
                if rowwise:
                    g_q, g_inv = quantize(grad, E4M3, 0)
                    x_q, x_inv = quantize(x, E4M3, 0)
                    g_inv = g_inv.reshape(-1, 1)
                g_t = _pad_rows(g_q).t().contiguous()  # zero tokens add nothing to the sum
                grad_w = _scaled_mm(g_t, g_inv, _column_major(_pad_rows(x_q)), x_inv, ctx.w_dtype, rowwise)
        return grad_x, grad_w, None, None


class Float8Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose three GEMMs run in float8 (module docstring); the same parameters and
    state-dict keys, so checkpoints, exports and LoRA merges see a plain linear layer.

        layer = Float8Linear.from_linear(torch.nn.Linear(64, 128), "rowwise")
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str = "tensorwise",
                 device: Any = None, dtype: torch.dtype | None = None):
        if recipe not in RECIPES:
            raise ValueError(f"Float8Linear recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
        if in_features % 16 or out_features % 16:
            raise ValueError(f"Float8Linear({in_features}, {out_features}): _scaled_mm needs both dimensions to be "
                             "multiples of 16; keep this layer an nn.Linear")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: str = "tensorwise") -> Float8Linear:
        """A ``Float8Linear`` holding ``linear``'s own parameter objects (optimizers and ties still see them)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        return new.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return F.linear(x, self.weight, self.bias)
        kind = x.device.type
        out_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        with torch.autocast(kind, enabled=False):
            y = _Float8Matmul.apply(x.reshape(-1, self.in_features), self.weight, self.recipe, out_dtype)
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(out_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


@dataclass
class Float8Report:
    """What ``convert_to_float8`` did: the layers now in float8, and the linear layers left alone, with why."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        left = "; ".join(f"{name}: {why}" for name, why in list(self.skipped.items())[:4])
        more = f" (+{len(self.skipped) - 4} more)" if len(self.skipped) > 4 else ""
        return (f"fp8 {self.recipe}: {len(self.converted)} linear layers in float8, {len(self.skipped)} left as they "
                f"were{': ' + left + more if left else ''}")

    def as_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "converted": len(self.converted), "skipped": dict(self.skipped)}


def convert_to_float8(model: torch.nn.Module, recipe: str = "tensorwise", skip: Iterable[str] = DEFAULT_SKIP,
                      skip_head: bool = True) -> Float8Report:
    """Swap ``model``'s eligible ``nn.Linear`` layers for ``Float8Linear`` in place (same parameters).

    Left alone, each with its reason in the report: the output layer (``skip_head``) and any linear
    layer whose weight is an embedding's (tied), layers whose qualified name matches a ``skip`` glob
    (default ``DEFAULT_SKIP``: LoRA adapters, MoE routers), layers whose shape ``_scaled_mm`` does not
    take (``fits``), subclasses of ``nn.Linear`` (their forward is their own) and layers with hooks.
    Convert before sharding (FSDP2) or compiling."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    patterns = list(skip)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    report, swaps = Float8Report(recipe), {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or isinstance(module, Float8Linear):
            continue
        why = _why_not(name, module, patterns, skip_head and module is head, id(module.weight) in embedded)
        if why:
            report.skipped[name] = why
        else:
            swaps[id(module)] = Float8Linear.from_linear(module, recipe)
            report.converted.append(name)
    # every path to a converted layer (one layer may sit under two names)
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if id(module) in swaps:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, swaps[id(module)])
    return report


def _why_not(name: str, linear: torch.nn.Linear, patterns: list[str], is_head: bool, tied: bool) -> str | None:
    if is_head:
        return "the output layer (its rounding would land on every token's log-prob)"
    if tied:
        return "its weight is an embedding's (tied)"
    hit = next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)
    if hit:
        return f"matches skip pattern {hit!r}"
    if type(linear) is not torch.nn.Linear:
        return f"{type(linear).__name__} subclasses nn.Linear with a forward of its own"
    if not fits(linear):
        return f"shape {linear.out_features}x{linear.in_features}: _scaled_mm needs both dimensions multiples of 16"
    if linear._forward_hooks or linear._forward_pre_hooks or linear._backward_hooks:
        return "has hooks (a wrapper owns its forward)"
    return None
