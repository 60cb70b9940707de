"""``Trainer``: one optimizer step of RL (GRPO, ``train/loss.py``) or SFT on ``rl.samples.Sample``s.

    model, tok = load_model("tiny-random")
    trainer = Trainer(model, tok, TrainConfig(lora=True, temperature=0.7))
    metrics = trainer.rl_step(samples, LossConfig(), normalizer=batch_size * max_tokens)
    policy = ModelPolicy(trainer.policy_pair(), temperature=0.7, policy_version=trainer.version)

A step is ``*_backward`` (micro-batches by token budget, one forward + backward each,
gradients accumulating) then ``optimizer_step`` (clip, AdamW, ``version += 1``); callers
that gather samples over time may call the two halves themselves. Every micro-batch of a
step divides by the SAME constant normaliser, so the gradient does not depend on how the
samples were split (tested). A micro-batch packs its samples end to end into one row, each
attending only within itself (``train/micro_batches.py``, ``train/document_attention.py``: SDPA
per document on the CPU, one compiled FlexAttention kernel a layer on CUDA, ``document_attention``;
``pack_sequences = false``: right-padded rows); a sample beginning with the tokens the row's
first begins with (the harness's system prompt, a group's prompt) is laid down without them and
attends to the first's copy (``share_prefixes``, exact). Log-probs are taken only at positions that
predict a loss token, through the output layer a chunk of ``logits_chunk_tokens`` at a time
(``train/head_logprobs.py``), so the [tokens, vocab] logits never exist whole (issue 32).

Precision: weights and AdamW state stay fp32; on CUDA with bf16 the forward runs under
bf16 autocast, and log-probs are always taken in fp32 (``head_token_logprobs``). ``fp8``: the
decoder's linear layers run their GEMMs in float8 (``train/fp8.py``; ``self.fp8`` says which). The model is
in train mode only inside a step, so sampling from ``policy_pair()`` between steps sees
eval mode.

Reference model for the KL term: with LoRA, the same model with adapters disabled; with
full fine-tuning, a frozen copy the caller keeps (``frozen_copy(model)``) and passes in.

Distributed (``train/distributed.py``): under torchrun, pass ``dist=init_from_env(device)``
(after loading the model, before building the trainer); the model is sharded with FSDP2
and every rank calls the same methods with the step's WHOLE sample list: each trains on
its token-balanced share, shorter shares are padded with zero-weight passes (FSDP2
gathers weights inside every pass, so all ranks must run as many), gradients are summed
over ranks and the metrics come back summed too, identical on every rank. N ranks give
the single-process update up to the order of float additions (tested).

Test: ``pytest tests/unit/train/test_trainer.py``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import time
from dataclasses import replace
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from opencomposer.models.moe_replay import replay_routes
from opencomposer.train.document_attention import attention_kind, document_attention
from opencomposer.train.fp8 import Float8Report, convert_to_float8, fp8_unsupported
from opencomposer.train.head_logprobs import head_token_logprobs
from opencomposer.train.host_memory import return_freed_memory
from opencomposer.train.loss import LossConfig, distill_kl, grpo_loss, token_logprobs
from opencomposer.train.micro_batches import Batch, collate, group_samples
from opencomposer.train.samples import Sample
from opencomposer.train import distributed
from opencomposer.train.config import TrainConfig
from opencomposer.train.distributed import Dist


log = logging.getLogger(__name__)


def frozen_copy(model: Any) -> Any:
    """A detached, gradient-free copy of ``model``: the KL reference for full fine-tuning."""
    if distributed.is_sharded(model):
        raise ValueError("frozen_copy of an FSDP-sharded model: make the reference from the unsharded model "
                         "before building the Trainer, or use LoRA (its reference is the base weights)")
    return freeze(copy.deepcopy(model))


def freeze(model: Any) -> Any:
    """``model`` itself in eval mode without gradients (a reference loaded for that alone)."""
    model.eval().requires_grad_(False)
    return model


class Trainer:
    """Holds the model being trained, its optimizer and the weights version."""

    def __init__(self, model: Any, tokenizer: Any, cfg: TrainConfig | None = None, name: str | None = None,
                 dist: Dist | None = None):
        self.cfg = cfg or TrainConfig()
        self.tokenizer = tokenizer
        self.name = name or str(getattr(model.config, "_name_or_path", "") or "model")
        self.dist = dist if dist is not None else distributed.current()
        self.device = distributed.rank_device(self.dist, next(model.parameters()).device)
        self.bf16 = _use_bf16(self.cfg.bf16, self.device)
        if self.cfg.lora:
            model = _add_lora(model, self.cfg, self.device)
        # after LoRA (its frozen base layers go to float8, its adapters stay), before FSDP2 shards the layers
        self.fp8: Float8Report | None = _to_float8(model, self.cfg.fp8, self.device)
        if self.device.type == "cpu" and self.cfg.return_host_memory:
            return_freed_memory()
        moe = any(name.endswith("mlp.experts") for name, _ in model.named_modules())  # LoRA-wrapped too
        if self.cfg.gradient_checkpointing is True and moe:
            # router replay's hooks live for the forward only: a recomputation in backward would route
            # its tokens afresh and save other tensors than the forward did
            raise ValueError("train.gradient_checkpointing=true with a mixture-of-experts model: recomputed "
                             "layers would not replay the sampled routes; use false or 'auto' (off for MoE)")
        if self.cfg.gradient_checkpointing is True or (self.cfg.gradient_checkpointing == "auto"
                                                       and self.device.type == "cpu" and not moe):
            _enable_checkpointing(model)
            if self.cfg.lora:  # frozen embeddings would cut the graph before the checkpoints
                model.enable_input_require_grads()
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters")
        bad = sorted({str(p.dtype) for p in trainable} - {"torch.float32"})
        if bad:
            raise ValueError(
                f"trainable parameters are {', '.join(bad)}; load the model in float32 "
                "(bf16 is applied by autocast per forward, keeping fp32 master weights)"
            )
        if self.dist.enabled:  # after LoRA and checkpointing wrap it, before the optimizer sees its parameters
            model = distributed.shard_model(model, self.dist, self.device, self.bf16)
        self.model = model.eval()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = self._optimizer(model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._packs = self.cfg.pack_sequences
        self._attention = attention_kind(self.cfg.document_attention, self.device, self.cfg.share_prefixes)  # sdpa | flex
        self.version = 0  # optimizer steps taken; the policy_version of fresh samples
        self.base_lr, self.schedule_start = self.cfg.lr, 0  # see set_lr / lr_at
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._keeps_logits = "logits_to_keep" in inspect.signature(base.forward).parameters

    def policy_pair(self) -> tuple[Any, Any]:
        """``(model, tokenizer)`` for ``ModelPolicy``: it samples from the current weights."""
        if self.dist.enabled:
            raise ValueError("a sharded model cannot sample on one rank (each forward needs every rank): give "
                             "an engine full_state_dict() instead")
        return self.model, self.tokenizer

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's whole weights under HF names (for an engine, an export, a weight store);
        LoRA: each adapted weight with its adapters' product added (``merged_lora_state``). Sharded: a collective (every rank must call it); rank 0 gets the tensors on the CPU, the
        other ranks an empty dict."""
        if not self.dist.enabled:
            return merged_lora_state(self.model) if self.cfg.lora else self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # ------------------------------------------------------------------ steps

    def rl_step(
        self, samples: list[Sample], loss_cfg: LossConfig, normalizer: float, ref_model: Any = None
    ) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.rl_backward(samples, loss_cfg, normalizer, ref_model)
        metrics.update(self.optimizer_step())
        return _timed(metrics, t0)

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """Mean cross-entropy over the batch's loss tokens (summed, / total loss tokens)."""
        t0 = time.perf_counter()
        metrics = self.sft_backward(samples, normalizer=max(sum(s.loss_tokens for s in samples), 1))
        metrics.update(self.optimizer_step())
        return _timed(metrics, t0)

    def rl_backward(
        self, samples: list[Sample], loss_cfg: LossConfig, normalizer: float, ref_model: Any = None
    ) -> dict[str, float]:
        """Accumulate the GRPO gradient of ``samples``; returns the loss metrics."""
        use_ref = loss_cfg.kl_coef > 0 or ref_model is not None
        if use_ref and ref_model is None and not self.cfg.lora:
            raise ValueError("kl_coef > 0 with full fine-tuning needs ref_model=frozen_copy(initial model)")
        cfg = replace(loss_cfg, normalizer=normalizer)
        means = ("kl", "clip_fraction", "ratio_mean", "mismatch_kl")  # token-weighted
        # is_corrected_fraction: a share of tokens, or at is_level = "sequence" of sequences
        per_seq = cfg.is_level == "sequence"
        sums = dict.fromkeys(("loss", "pg_loss", "entropy", "is_corrected", *means), 0.0)
        sums.update(ratio_max=0.0, mismatch_max=0.0, tokens=0.0, loss_tokens=0.0, sequences=0.0)
        # MoE: tokens whose experts the sampler recorded, routed there again (models/moe_replay.py)
        sums["replayed_route_tokens"] = float(sum(s.routes.shape[0] for s in samples
                                                  if s.routes is not None and s.loss_tokens))
        with self._training():
            for b, idle in self._passes(samples):
                ref = self._reference_logprobs(b, ref_model) if use_ref else None
                lp, ent = self._logprobs(self.model, b, self.cfg.logprob_temperature)
                loss, stats = grpo_loss(lp, b.old, b.adv, b.mask, ref, cfg, seq_ids=b.seq)
                (loss * 0 if idle else loss).backward()
                if idle:
                    continue
                n = stats["tokens"]
                sums["loss"] += stats["loss"]
                sums["pg_loss"] += stats["pg_loss"]
                for key in means:
                    sums[key] += stats[key] * n
                sums["is_corrected"] += stats["is_corrected_fraction"] * (stats["sequences"] if per_seq else n)
                sums["sequences"] += stats["sequences"]
                sums["entropy"] += float((ent * b.mask).sum())
                for key in ("ratio_max", "mismatch_max"):
                    sums[key] = max(sums[key], stats[key])
                sums["tokens"] += b.tokens
                sums["loss_tokens"] += n
        sums = distributed.reduce_metrics(sums, self.dist, maxed=("ratio_max", "mismatch_max"))
        n = max(sums["loss_tokens"], 1.0)
        for key in (*means, "entropy"):
            sums[key] /= n
        sums["is_corrected_fraction"] = sums.pop("is_corrected") / max(sums["sequences"] if per_seq else n, 1.0)
        return sums

    def distill_backward(self, pairs: list[tuple[Sample, Sample]], coef: float, normalizer: float) -> dict[str, float]:
        """Accumulate the gradient of ``coef * sum KL(teacher || student) / normalizer``.

        Each pair is (student, teacher): the same completion tokens (``loss_mask``) after
        two contexts, the one the policy saw and the one with a hint inserted
        (``rl/feedback.py``). The teacher is the current weights, without gradient.
        """
        sums = {"distill_kl": 0.0, "distill_tokens": 0.0}
        t = self.cfg.logprob_temperature
        for student, teacher in pairs:
            if student.loss_tokens != teacher.loss_tokens:
                raise ValueError(f"distill pair of task {student.task_id!r}: student has {student.loss_tokens} "
                                 f"loss tokens, teacher {teacher.loss_tokens}")
        mine = distributed.share(pairs, [len(s) + len(t) for s, t in pairs], self.dist)
        with self._training():
            for pair in self._evened(mine):
                idle = pair is None
                sb, tb = (self._idle_batch(),) * 2 if idle else (self._collate([pair[0]]), self._collate([pair[1]]))
                with torch.no_grad():
                    t_logits = self._logits(self.model, tb)
                kl = distill_kl(self._logits(self.model, sb), t_logits, t)
                loss = coef * (kl * sb.mask).sum() / normalizer
                (loss * 0 if idle else loss).backward()
                if idle:
                    continue
                sums["distill_kl"] += float((kl.detach() * sb.mask).sum())
                sums["distill_tokens"] += float(sb.mask.sum())
        sums = distributed.reduce_metrics(sums, self.dist)
        sums["distill_kl"] /= max(sums["distill_tokens"], 1.0)
        return sums

    def sft_backward(self, samples: list[Sample], normalizer: float) -> dict[str, float]:
        """Accumulate the gradient of -sum(log p(loss tokens)) / ``normalizer``."""
        sums = {"loss": 0.0, "tokens": 0.0, "loss_tokens": 0.0}
        with self._training():
            for b, idle in self._passes(samples):
                loss = (self._nll(b) * b.mask).sum() / normalizer
                (loss * 0 if idle else loss).backward()
                if idle:
                    continue
                sums["loss"] += float(loss.detach())
                sums["tokens"] += b.tokens
                sums["loss_tokens"] += float(b.mask.sum())
        return distributed.reduce_metrics(sums, self.dist)

    def clip_gradients(self) -> float:
        """Clip the accumulated gradients to ``grad_clip``; returns their norm before clipping."""
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        # sharded: a DTensor over every rank's gradients, the same global norm on each
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def set_lr(self, lr: float) -> None:
        """A new base learning rate from the next step on, warmed up again from there (a new
        stage: SFT before RL, RL after SFT)."""
        self.base_lr, self.schedule_start = lr, self.version

    def lr_at(self, version: int) -> float:
        """The learning rate of the step that turns weights ``version`` into ``version + 1``."""
        w = self.cfg.warmup_steps
        return self.base_lr * min(1.0, (version - self.schedule_start + 1) / w) if w else self.base_lr

    def _optimizer(self, model: Any) -> torch.optim.Optimizer:
        """AdamW, or Muon + AdamW (``train/muon.py``) by ``cfg.optimizer``, over the trainable parameters."""
        c = self.cfg
        if c.optimizer == "muon":
            from opencomposer.train.muon import MuonAdamW

            return MuonAdamW(model.named_parameters(), lr=c.lr, momentum=c.muon_momentum, betas=tuple(c.betas),
                             eps=c.adam_eps, weight_decay=c.weight_decay)
        return torch.optim.AdamW(self.params, lr=c.lr, betas=tuple(c.betas), eps=c.adam_eps,
                                 weight_decay=c.weight_decay)

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, clear gradients; a non-finite gradient skips the step (version unchanged)."""
        norm = self.clip_gradients()
        skipped = not math.isfinite(norm)
        lr = self.lr_at(self.version)
        if not skipped:
            for group in self.optimizer.param_groups:  # the schedule is a function of the version
                group["lr"] = lr
            self.optimizer.step()
            self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm, "skipped": float(skipped), "version": float(self.version), "lr": lr}

    # ------------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _training(self) -> Iterator[None]:
        # Packed: document attention until the backward passes are done too, since activation
        # checkpointing runs the layers' forward again there.
        self.model.train()
        try:
            with document_attention(self.model, self._attention) if self._packs else contextlib.nullcontext():
                yield
        finally:
            self.model.eval()

    def _passes(self, samples: list[Sample]) -> Iterator[tuple[Batch, bool]]:
        """``(micro-batch, idle)`` for this rank's share of the step's ``samples``; idle passes
        (``_idle_batch``, whose loss the caller zeroes) pad it to the count of the busiest rank."""
        trainable = [s for s in samples if s.loss_tokens]  # the rest would add nothing but time
        if not trainable:
            raise ValueError(f"no samples to train on: {len(samples)} given, none with loss tokens")
        groups = self._micro_batches(distributed.share(trainable, [len(s) for s in trainable], self.dist))
        for g in self._evened(groups):
            yield (self._idle_batch(), True) if g is None else (self._collate(g), False)

    def _evened(self, items: list) -> Iterator[Any]:
        """``items``, then ``None`` until this rank has as many passes as the rank with the most.
        The count is agreed before the first pass: a collective between passes would meet another
        rank's all-gather."""
        passes = distributed.equal_count(len(items), self.dist)
        yield from items
        yield from [None] * (passes - len(items))

    def _micro_batches(self, samples: list[Sample]) -> list[list[Sample]]:
        return group_samples(samples, self.cfg.micro_batch_tokens, self._packs, self.cfg.share_prefixes)

    def _idle_batch(self) -> Batch:
        """Two pad tokens, one of them a loss position: a pass that runs every layer (and so
        every FSDP2 collective) and whose loss the caller multiplies by zero."""
        return self._collate([Sample(input_ids=[self.pad_id] * 2, loss_mask=[0, 1], old_logprobs=[0.0, 0.0],
                                     advantage=0.0, task_id="(idle)")])

    def _collate(self, batch: list[Sample]) -> Batch:
        return collate(batch, self.pad_id, self.device, self._packs, self.cfg.share_prefixes)

    def _forward(self, model: Any, b: Batch, **kw: Any) -> Any:
        """``model``'s forward on ``b`` under autocast, packed documents attending each within itself;
        a MoE model's tokens go to the experts the sampler chose where the samples recorded them
        (``models.moe_replay``)."""
        packed = document_attention(model, self._attention) if b.packed else contextlib.nullcontext()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16), \
                replay_routes(model, b.routes), packed:
            return model(input_ids=b.ids, attention_mask=b.attn, position_ids=b.positions, use_cache=False, **kw)

    def _logits(self, model: Any, b: Batch) -> torch.Tensor:
        """(rows, len(keep), vocab) logits at the kept positions only."""
        if self._keeps_logits:
            return self._forward(model, b, logits_to_keep=b.keep).logits
        return self._forward(model, b).logits[:, b.keep]  # older transformers: every position's logits

    def _chunks_head(self, model: Any) -> torch.nn.Linear | None:
        """The output layer, where log-probs go through it a chunk of tokens at a time
        (``train/head_logprobs.py``): not with ``logits_chunk_tokens = 0``, a LoRA-wrapped head or a
        sharded model (whose root weights live inside the root forward)."""
        head = _plain_head(model)
        return None if self.cfg.logits_chunk_tokens == 0 or self.dist.enabled else head

    def _logprobs(self, model: Any, b: Batch, temperature: float, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p(targets), entropy) at the kept positions."""
        head = self._chunks_head(model)
        if head is None:
            return token_logprobs(self._logits(model, b), b.targets, temperature)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        hidden = self._forward(base.get_decoder(), b).last_hidden_state[:, b.keep]
        dtype = torch.bfloat16 if self.bf16 else head.weight.dtype
        return head_token_logprobs(hidden, head.weight, head.bias, b.targets, temperature,
                                   self.cfg.logits_chunk_tokens, entropy, dtype)

    def _nll(self, b: Batch) -> torch.Tensor:
        """-log p(targets) at the kept positions; without the chunked head by cross-entropy,
        which skips the entropy SFT never reads."""
        if self._chunks_head(self.model) is not None:
            return -self._logprobs(self.model, b, 1.0, entropy=False)[0]
        logits = self._logits(self.model, b).float()
        return F.cross_entropy(logits.flatten(0, 1), b.targets.flatten(), reduction="none").view_as(b.mask)

    @torch.no_grad()
    def _reference_logprobs(self, b: Batch, ref_model: Any) -> torch.Tensor:
        t = self.cfg.logprob_temperature
        if ref_model is not None:
            return self._logprobs(ref_model, b, t, entropy=False)[0]
        with self.model.disable_adapter():  # LoRA: the base weights are the reference
            return self._logprobs(self.model, b, t, entropy=False)[0]


def _plain_head(model: Any) -> torch.nn.Linear | None:
    """The output layer when it is a plain ``nn.Linear`` (not LoRA-wrapped), else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if type(head) is torch.nn.Linear else None


def _timed(metrics: dict[str, float], t0: float) -> dict[str, float]:
    seconds = time.perf_counter() - t0
    metrics["seconds"] = seconds
    metrics["tokens_per_second"] = metrics["tokens"] / seconds if seconds > 0 else 0.0
    return metrics


def _use_bf16(setting: bool | str, device: torch.device) -> bool:
    """bf16 autocast wherever the hardware has it natively: CUDA with bf16, or a CPU with
    AVX512-BF16/AMX (~1.6x faster fwd+bwd for SmolLM2-135M on the 2-core VM). 'auto' picks
    it when available; ``true`` insists. The trainer-vs-sampler log-prob gap it adds is
    what the clipped importance ratio absorbs (and what issue 6 measures)."""
    if device.type == "cuda":
        capable = torch.cuda.is_bf16_supported()
    else:
        capable = device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if setting == "auto":
        return capable
    if setting and not capable:
        raise ValueError(f"TrainConfig.bf16=true needs bf16 support (CUDA, or a CPU with AVX512-BF16/AMX); "
                         f"the model is on {device}")
    return bool(setting)


def _to_float8(model: Any, recipe: str, device: torch.device) -> Float8Report | None:
    """``[train] fp8``: the decoder's linear layers to float8 GEMMs (``train/fp8.py``), said once in the log;
    refused where FP8 GEMMs do not run."""
    if recipe == "off":
        return None
    why = fp8_unsupported(device)
    if why:
        raise ValueError(f"train.fp8 = {recipe!r}: {why}; set train.fp8 = \"off\" here")
    report = convert_to_float8(model, recipe)
    if not report.converted:
        raise ValueError(f"train.fp8 = {recipe!r}: no linear layer could take float8 GEMMs ({report.summary()})")
    log.info(report.summary())
    return report


def _enable_checkpointing(model: Any) -> None:
    # transformers 5 renamed it to activation checkpointing; older releases only have the old name.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _add_lora(model: Any, cfg: TrainConfig, device: torch.device) -> Any:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
        target_modules=cfg.lora_target_modules, task_type="CAUSAL_LM",
    )
    # Seed only the adapter init (A is random, B zero), leaving the caller's RNG alone.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed)
        return get_peft_model(model, lora)


def merged_lora_state(model: Any) -> dict[str, torch.Tensor]:
    """A PEFT LoRA model's weights as the plain model's state dict: every adapted layer's weight
    plus its active adapters' ``B @ A * scaling``, under the base model's own names. Computed
    beside the weights (never merged in place, which would move the trained base weights by
    rounding on every unmerge)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and not module.merged:
                active = [a for a in module.active_adapters if a in module.lora_A]
                if active:
                    deltas[f"{name}.weight"] = sum(module.get_delta_weight(a) for a in active)
        out = {}
        for key, value in base.state_dict().items():
            if ".lora_" in key:
                continue
            plain = key.replace(".base_layer.", ".")
            out[plain] = value + deltas[plain].to(value.dtype) if plain in deltas else value
    missing = set(deltas) - set(out)
    if missing:
        raise ValueError(f"LoRA layers without a base weight under the plain names: {sorted(missing)[:3]}")
    return out
