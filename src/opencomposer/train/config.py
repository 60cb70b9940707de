"""``TrainConfig``: optimiser, LoRA, precision and batching settings of a ``Trainer``.

Loaded from a TOML table like every config (``config.load_config``)::

    [train]
    lr = 1e-5
    lora = true
    lora_r = 16
    temperature = 0.7   # the sampler's, so importance ratios compare like with like

Test: ``pytest tests/unit/train``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from opencomposer.config import Strict


class TrainConfig(Strict):
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate")
    warmup_steps: int = Field(
        0, ge=0, description="linear warm-up: step n (1-based) uses lr * min(1, n / warmup_steps); 0 = off. "
        "AdamW's first steps move every weight by about lr whatever the gradient's size")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 = measure only")
    micro_batch_tokens: int = Field(
        8192, ge=1, description="padded tokens (rows x longest row) per forward; a longer sequence goes alone"
    )
    lora: bool = False
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    # Dropout makes the trainer's log-probs differ from the sampler's on the same weights,
    # which biases RL importance ratios; keep 0 for RL.
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] | Literal["all-linear"] = "all-linear"
    bf16: bool | Literal["auto"] = Field("auto", description="bf16 autocast; 'auto' = where native (CUDA bf16, CPU AVX512-BF16/AMX)")
    gradient_checkpointing: bool = False
    seed: int = 0
    # The sampler's temperature; 0 (greedy) means 1, since greedy logprobs are temperature-1.
    temperature: float = Field(1.0, ge=0)

    @property
    def logprob_temperature(self) -> float:
        return self.temperature if self.temperature > 0 else 1.0
