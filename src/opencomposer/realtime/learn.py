"""Logged completions + rewards -> policy-gradient samples -> one epoch of GRPO-style updates.

    samples, skipped = completion_samples(window.completions, scored.rewards, temperature=0.7)
    metrics = train_candidate("tiny-random", samples, cfg, out=Path("runs/rt/candidates/cycle-0001"))

A logged completion is already a training sequence: the prompt's token ids (exactly what
the engine was given) followed by the sampled token ids, loss on the sampled tokens only,
with the sampler's log-probs as the "old" policy of the clipped importance ratio
(``train/loss.py``). Nothing is re-rendered, so a token is never trained on in a context the
model did not see.

Advantages: production has no K rollouts of one prompt, so the baseline is the window:
``A_c = r_c - mean(r over the window)`` (``rl.advantages.group_advantages`` with the
whole window as one group; ``/ std`` with ``reward.std_normalize``). One pass over the
window (single epoch, newest ``max_completions``), ``batch_completions`` per optimizer
step, each step's loss summed over tokens and divided by the constant
``max_tokens * batch size`` (no per-sequence length normalisation), as in ``rl/run.py``.

Skipped (counted by reason, never silently): completions another A/B arm served
(``learn.only_own_arm``: their tokens came from other weights), completions without tokens, whose
log-probs do not match their tokens, or sampled at another temperature than the one the
trainer computes log-probs at (their ratios would compare different distributions).

Test: ``pytest tests/unit/realtime/test_rewards.py`` (completion_samples); the training step in ``tests/integration/test_realtime_cycle.py``.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

from opencomposer.realtime.config import RealtimeConfig
from opencomposer.rl.advantages import group_advantages
from opencomposer.train.loss import LossConfig
from opencomposer.train.samples import NOT_GENERATED, Sample


def completion_samples(completions: list[dict], rewards: dict[str, float], temperature: float,
                       std_normalize: bool = False, max_completions: int | None = None,
                       vocab_size: int | None = None, arm: str | None = None) -> tuple[list[Sample], Counter]:
    """One ``Sample`` per usable completion (of ``arm`` only, when given), with window-baseline advantages."""
    want = temperature if temperature > 0 else 1.0
    usable, skipped = [], Counter()
    for c in completions:
        ids, lps, prompt = c.get("token_ids") or [], c.get("logprobs") or [], c.get("prompt_ids") or []
        t = float(c.get("temperature", 1.0))
        if arm is not None and c.get("arm") != arm:
            skipped["other_arm"] += 1
        elif c["id"] not in rewards:
            skipped["no_reward"] += 1
        elif not ids or not prompt:
            skipped["no_tokens"] += 1
        elif len(ids) != len(lps):
            skipped["logprobs_mismatch"] += 1
        elif abs((t if t > 0 else 1.0) - want) > 1e-6:
            skipped["other_temperature"] += 1
        elif vocab_size is not None and any(not 0 <= x < vocab_size for x in prompt + ids):
            skipped["token_out_of_vocab"] += 1
        else:
            usable.append(c)
    if max_completions is not None and len(usable) > max_completions:
        skipped["over_max_completions"] += len(usable) - max_completions
        usable = usable[-max_completions:]
    if not usable:
        return [], skipped
    adv = group_advantages([rewards[c["id"]] for c in usable], std_normalize=std_normalize)
    samples = []
    for c, a in zip(usable, adv):
        p, ids = list(c["prompt_ids"]), list(c["token_ids"])
        version = int(c.get("policy_version") or 0)
        samples.append(Sample(
            input_ids=p + ids, loss_mask=[0] * len(p) + [1] * len(ids),
            old_logprobs=[0.0] * len(p) + [float(x) for x in c["logprobs"]], advantage=a,
            policy_version=[NOT_GENERATED] * len(p) + [version] * len(ids),
            task_id=str(c.get("session_id") or ""), group_id="window"))
    return samples, skipped


def train_candidate(model_path: str, samples: list[Sample], cfg: RealtimeConfig, out: Path) -> dict[str, Any]:
    """Load ``model_path``, one epoch over ``samples``, export the result to ``out`` (atomic)."""
    from opencomposer.models.registry import load_model
    from opencomposer.train.export import export_model
    from opencomposer.train.trainer import Trainer

    t0 = time.perf_counter()
    model, tok = load_model(model_path, device=cfg.model.device)
    trainer = Trainer(model, tok, cfg.train, name=model_path)
    t1 = time.perf_counter()
    loss_cfg = LossConfig(**cfg.loss.loss_kwargs())  # kl_coef is 0 here (RealtimeConfig refuses it)
    step_rows, bs = [], cfg.learn.batch_completions
    trainable = [s for s in samples if s.advantage != 0.0]  # zero advantage, no KL: zero gradient
    for i in range(0, len(trainable), bs):
        batch = trainable[i:i + bs]
        m = trainer.rl_step(batch, loss_cfg, normalizer=float(cfg.learn.max_tokens * len(batch)))
        step_rows.append({k: round(float(m[k]), 6) for k in ("loss", "pg_loss", "grad_norm", "clip_fraction",
                                                              "ratio_mean", "ratio_max", "entropy", "tokens")
                          if k in m})
    t2 = time.perf_counter()
    export_model(out, trainer)
    t3 = time.perf_counter()
    return {"candidate": str(out), "optimizer_steps": trainer.version, "samples": len(samples),
            "trained_samples": len(trainable), "loss_tokens": sum(s.loss_tokens for s in trainable),
            "steps": step_rows, "seconds_load": round(t1 - t0, 2), "seconds_train": round(t2 - t1, 2),
            "seconds_save": round(t3 - t2, 2)}
