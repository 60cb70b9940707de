"""``TrainConfig``: optimiser, LoRA, precision and batching settings of a ``Trainer``; and
``PretrainRunConfig``, the root of ``opencomposer pretrain --config`` (``configs/pretrain/pretrain.toml``).

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

from pydantic import Field, model_validator

from opencomposer.config import Strict


class TrainConfig(Strict):
    lr: float = Field(1e-5, gt=0, description="learning rate (AdamW's; Muon's update is scaled to AdamW's RMS)")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="adamw | muon: Muon on the hidden layers' matrices, AdamW on the rest (train/muon.py); "
        "not yet under torchrun")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon's (Nesterov) momentum")
    warmup_steps: int = Field(
        0, ge=0, description="linear warm-up: step n (1-based) uses lr * min(1, n / warmup_steps); 0 = off. "
        "AdamW's first steps move every weight by about lr whatever the gradient's size")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 = measure only")
    micro_batch_tokens: int = Field(
        8192, ge=1, description="tokens per forward (packed; padded: rows x longest row); a longer sequence goes alone"
    )
    pack_sequences: bool = Field(
        True, description="pack a micro-batch's samples into one row, each attending only within itself; "
        "false: one right-padded row per sample")
    share_prefixes: bool = Field(
        True, description="packed rows: a sample that begins like the row's first (the system prompt and tools, "
        "a GRPO group's prompt) is laid down without those tokens and attends to the first's copy; exact, and "
        "~1.1k fewer tokens a sample for the harness's prompt")
    document_attention: Literal["auto", "sdpa", "flex"] = Field(
        "auto", description="packed rows' attention within each document (train/document_attention.py): sdpa = "
        "one SDPA call per document (the CPU's); flex = one compiled FlexAttention kernel a layer over the whole "
        "row (needs CUDA and triton); auto = flex where it runs (a CUDA device, triton) and share_prefixes is on "
        "(3.1x the sdpa loop on RL groups, one H200), else sdpa (whole documents: flash attention, faster there)")
    logits_chunk_tokens: int = Field(
        1024, ge=0, description="tokens whose vocabulary-wide logits exist at once when taking log-probs "
        "(recomputed in backward); 0 = all of a micro-batch's at once")
    lora: bool = False
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    # Dropout makes the trainer's log-probs differ from the sampler's on the same weights,
    # which biases RL importance ratios; keep 0 for RL.
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] | Literal["all-linear"] = "all-linear"
    bf16: bool | Literal["auto"] = Field("auto", description="bf16 autocast; 'auto' = where native (CUDA bf16, CPU AVX512-BF16/AMX)")
    fp8: Literal["off", "tensorwise", "rowwise"] = Field(
        "off", description="FP8 GEMMs in the linear layers of the decoder (train/fp8.py): e4m3 operands, e5m2 "
        "gradients, one scale a tensor (tensorwise) or e4m3 throughout with a scale a row (rowwise); the output "
        "layer, embeddings and LoRA adapters stay as they are. Needs CUDA compute capability 8.9+; pays on "
        "large GEMMs only (hidden sizes in the thousands), not on a 135M model")
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="recompute each layer's activations in backward; 'auto' = on the CPU (an 8k-token "
        "micro-batch of the embedded model: 13.8 GB resident without, under 4 with), off on GPUs (~1/3 more compute) "
        "and for mixture-of-experts models (recomputation would not replay the sampled routes)")
    return_host_memory: bool = Field(
        True, description="on the CPU, give freed tensor memory back to the OS at once (train/host_memory.py); "
        "glibc's heap otherwise keeps about twice the activations' high-water mark resident")
    seed: int = 0
    checkpoint_format: Literal["full", "sharded"] = Field(
        "full", description="full: one process's files (weights and AdamW state gathered to rank 0, which writes); "
        "sharded: every rank writes its own shards (torch.distributed.checkpoint), none holds the whole state. "
        "Resuming reads either, on any number of ranks")
    # The sampler's temperature; 0 (greedy) means 1, since greedy logprobs are temperature-1.
    temperature: float = Field(1.0, ge=0)

    @property
    def logprob_temperature(self) -> float:
        return self.temperature if self.temperature > 0 else 1.0


class PretrainSection(Strict):
    """``[pretrain]`` of ``opencomposer pretrain --config``: continued pretraining (``train/pretrain.py``)."""

    data: list[str] = Field(default_factory=list, description="files or directories, each 'path' or "
                            "'path:weight' (weight 2 = its windows twice a pass)")
    eval_data: list[str] = Field(default_factory=list, description="other codebases, measured before and after "
                                 "(never trained on)")
    model: str = Field("smollm2-135m", description="smollm2-135m | tiny-random | a local HF dir")
    out_dir: str = "runs/pretrain"
    steps: int = Field(100, ge=1, description="optimizer steps")
    seq_len: int = Field(256, ge=2, description="tokens per window")
    batch_size: int = Field(8, ge=1, description="windows per optimizer step (the global batch)")
    lr: float = Field(1e-4, gt=0, description="peak learning rate")
    warmup_steps: int = Field(10, ge=0, description="linear warm-up to lr, then a cosine")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the cosine ends at lr * min_lr_ratio")
    held_out: float = Field(0.05, ge=0, lt=1, description="share of documents held out (by a hash of the path)")
    eval_every: int = Field(25, ge=0, description="held-out loss every N steps (0: before and after only)")
    eval_windows: int = Field(32, ge=1, description="held-out windows measured per eval set")
    save_every: int = Field(50, ge=0, description="checkpoint every N steps (0: only at the end)")
    seed: int = 0
    context_factor: float = Field(1.0, ge=1, description="long-context extension: the model's context times this "
                                  "by YaRN RoPE scaling (train/long_context.py), applied before the first step; "
                                  "1: none. Train on windows up to the new context (seq_len)")
    eval_lengths: list[int] = Field(default_factory=list, description="held-out loss also on windows of these "
                                    "lengths (of the training mix's held-out documents), e.g. the native context "
                                    "and 4x it; with context_factor > 1 also measured with the native RoPE first")

    @model_validator(mode="after")
    def _lengths(self) -> PretrainSection:
        bad = [n for n in self.eval_lengths if n < 2]
        if bad:
            raise ValueError(f"pretrain.eval_lengths: {bad[0]} is not a window length (at least 2 tokens)")
        return self


class PretrainRunConfig(Strict):
    """Root config of ``opencomposer pretrain`` (``configs/pretrain/*.toml``)."""

    pretrain: PretrainSection = PretrainSection()
    train: TrainConfig = TrainConfig(weight_decay=0.1, betas=(0.9, 0.95))

    @model_validator(mode="after")
    def _one_schedule(self) -> PretrainRunConfig:
        # the schedule (warm-up, cosine) is [pretrain]'s; two learning rates would leave one silently unused
        both = sorted({"lr", "warmup_steps"} & self.train.model_fields_set)
        if both:
            raise ValueError(f"set {' and '.join('pretrain.' + k for k in both)} instead of "
                             f"{' and '.join('train.' + k for k in both)}: the schedule of continued pretraining is the pretrain table's")
        return self
