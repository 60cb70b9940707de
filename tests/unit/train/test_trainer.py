"""The Trainer on a real tiny-random model: on-policy ratios, LoRA, clipping, batching, SFT."""

from __future__ import annotations

import math

import pytest
import torch

from opencomposer.policies.model import ModelPolicy
from opencomposer.train.loss import LossConfig
from opencomposer.train import TrainConfig, Trainer, frozen_copy

from testkit.train_data import grads, params, rollout_samples


def test_rl_step_is_on_policy_then_updates_the_weights(tiny):
    trainer = Trainer(*tiny, TrainConfig(bf16=False, lr=1e-3, temperature=0.7))
    # Sampled through ModelPolicy from the trainer's own weights at the same temperature,
    # so the recomputed log-probs must equal the sampler's: ratio 1 on every token.
    samples = rollout_samples(*trainer.policy_pair(), n=4, temperature=0.7)
    before = params(trainer.model)
    m = trainer.rl_backward(samples, LossConfig(), normalizer=64.0)
    assert abs(m["ratio_mean"] - 1) < 1e-4 and m["ratio_max"] < 1 + 1e-3 and m["clip_fraction"] == 0
    assert m["loss_tokens"] == sum(s.loss_tokens for s in samples) and m["tokens"] == sum(map(len, samples))
    assert m["entropy"] > 0
    step = trainer.optimizer_step()
    assert math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0 and step["skipped"] == 0
    assert trainer.version == 1 and not trainer.model.training  # back in eval mode for sampling
    after = params(trainer.model)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    # the policy built from policy_pair() now samples from the updated weights
    policy = ModelPolicy(trainer.policy_pair(), temperature=0.7, policy_version=trainer.version, max_new_tokens=2)
    assert policy.model is trainer.model


def test_lora_trains_only_the_adapters_and_uses_the_base_as_reference(tiny):
    trainer = Trainer(*tiny, TrainConfig(bf16=False, lr=1e-3, lora=True, lora_r=4, temperature=1.0))
    samples = rollout_samples(*trainer.policy_pair(), n=4)
    before = params(trainer.model)
    m = trainer.rl_step(samples, LossConfig(kl_coef=0.1), normalizer=64.0)
    assert abs(m["kl"]) < 1e-5  # adapters start as a no-op (B = 0): policy == reference
    after = params(trainer.model)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert changed and all("lora_" in n for n in changed)
    m2 = trainer.rl_step(samples, LossConfig(kl_coef=0.1), normalizer=64.0)
    assert m2["kl"] != 0.0 and trainer.version == 2


def test_full_fine_tuning_kl_needs_a_frozen_reference(tiny):
    model, tok = tiny
    ref = frozen_copy(model)
    trainer = Trainer(model, tok, TrainConfig(bf16=False, lr=1e-3))
    samples = rollout_samples(model, tok, n=2)
    with pytest.raises(ValueError, match="needs ref_model"):
        trainer.rl_step(samples, LossConfig(kl_coef=0.1), normalizer=32.0)
    assert abs(trainer.rl_step(samples, LossConfig(kl_coef=0.1), 32.0, ref_model=ref)["kl"]) < 1e-5
    assert trainer.rl_step(samples, LossConfig(kl_coef=0.1), 32.0, ref_model=ref)["kl"] != 0.0


def test_the_gradient_does_not_depend_on_micro_batching_or_checkpointing(tiny):
    from opencomposer.models import load_model

    samples = rollout_samples(*tiny, n=5)
    one = Trainer(*tiny, TrainConfig(bf16=False, micro_batch_tokens=100_000))
    many = Trainer(*load_model("tiny-random"), TrainConfig(bf16=False, micro_batch_tokens=40, gradient_checkpointing=True))
    m1 = one.rl_backward(samples, LossConfig(), normalizer=80.0)
    m2 = many.rl_backward(samples, LossConfig(), normalizer=80.0)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5, abs=1e-7)
    g1, g2 = grads(one.model), grads(many.model)
    assert g1.keys() == g2.keys() and g1
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-7, msg=n)


def test_the_grad_norm_is_reported_and_clipped(tiny):
    trainer = Trainer(*tiny, TrainConfig(bf16=False, grad_clip=1e-3))
    trainer.rl_backward(rollout_samples(*tiny, n=2), LossConfig(), normalizer=32.0)
    norm = trainer.clip_gradients()
    assert norm > 1e-3
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.params if p.grad is not None]))
    assert float(clipped) <= 1e-3 * (1 + 1e-4)


def test_sft_steps_lower_the_loss_on_a_repeated_batch(tiny):
    trainer = Trainer(*tiny, TrainConfig(bf16=False, lr=3e-3))
    samples = rollout_samples(*tiny, n=3)
    with torch.no_grad():  # the loss is the mean NLL of the loss tokens, from a plain forward
        nll = []
        for s in samples:
            logp = trainer.model(input_ids=torch.tensor([s.input_ids])).logits[0, :-1].log_softmax(-1)
            nll += [-float(logp[t - 1, s.input_ids[t]]) for t in range(1, len(s)) if s.loss_mask[t]]
    losses = [trainer.sft_step(samples)["loss"] for _ in range(5)]
    assert losses[0] == pytest.approx(sum(nll) / len(nll), rel=1e-5)
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 1.0, losses


def test_bad_settings_are_refused(tiny):
    model, tok = tiny
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # CPU with native bf16: allowed when asked
        assert Trainer(model, tok, TrainConfig(bf16=True)).bf16 is True
        assert Trainer(model, tok, TrainConfig(bf16="auto")).bf16 is True
    else:
        with pytest.raises(ValueError, match="bf16=true needs bf16 support"):
            Trainer(model, tok, TrainConfig(bf16=True))
        assert Trainer(model, tok, TrainConfig(bf16="auto")).bf16 is False
    with pytest.raises(ValueError, match="load the model in float32"):
        Trainer(model.to(torch.bfloat16), tok, TrainConfig(bf16=False))
    with pytest.raises(ValueError, match="no samples to train on: 0 given"):
        Trainer(model.float(), tok).rl_step([], LossConfig(), 1.0)


def test_warmup_ramps_the_learning_rate_linearly(tiny):
    """warmup_steps = 4: steps 1..4 use lr/4, lr/2, 3lr/4, lr, and later steps lr. The schedule
    follows the weights version, so a trainer restored from a checkpoint continues it. With
    AdamW the first update moves each weight by about the lr, so a warmed step 1 moves the
    weights ~1/4 as far as an un-warmed one."""
    import copy

    model, tok = tiny
    samples = rollout_samples(model, tok, n=2)
    start = params(model)

    def first_step_change(cfg: TrainConfig) -> float:
        m = copy.deepcopy(model)
        Trainer(m, tok, cfg).sft_step(samples)
        return max((p - start[n]).abs().max().item() for n, p in params(m).items())

    plain = first_step_change(TrainConfig(bf16=False, lr=1e-3))
    warmed = first_step_change(TrainConfig(bf16=False, lr=1e-3, warmup_steps=4))
    assert warmed == pytest.approx(plain / 4, rel=0.05), (plain, warmed)
    warm = Trainer(copy.deepcopy(model), tok, TrainConfig(bf16=False, lr=1e-3, warmup_steps=4))
    lrs = [warm.sft_step(samples)["lr"] for _ in range(5)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    warm.set_lr(2e-3)  # a new stage (RL after SFT) warms up again from its own start
    assert [warm.sft_step(samples)["lr"] for _ in range(2)] == pytest.approx([5e-4, 1e-3])


def test_the_sampler_trainer_mismatch_is_logged_and_corrected(tiny):
    """A sampler that gave every generated token a quarter of the trainer's probability (as a
    drifted engine would): the step logs that mismatch, and truncated importance weights (cap 2)
    touch every generated token."""
    import dataclasses

    trainer = Trainer(*tiny, TrainConfig(bf16=False, lr=1e-3, temperature=1.0))
    samples = rollout_samples(*trainer.policy_pair(), n=2, temperature=1.0)
    drifted = [dataclasses.replace(s, old_logprobs=[lp - math.log(4) if m else lp
                                                    for lp, m in zip(s.old_logprobs, s.loss_mask)]) for s in samples]
    m = trainer.rl_backward(samples, LossConfig(), normalizer=64.0)
    assert abs(m["mismatch_kl"]) < 1e-4 and m["is_corrected_fraction"] == 0.0
    trainer.optimizer.zero_grad(set_to_none=True)
    m = trainer.rl_backward(drifted, LossConfig(is_correction="truncate", is_cap=2.0), normalizer=64.0)
    assert m["mismatch_kl"] == pytest.approx(-math.log(4), abs=1e-3)
    assert m["mismatch_max"] == pytest.approx(math.log(4), abs=1e-3)
    assert m["is_corrected_fraction"] == 1.0 and m["clip_fraction"] == 0.0


def test_lora_weights_reach_an_engine_merged_under_the_plain_names():
    import copy

    from opencomposer.models import load_model
    from opencomposer.train.trainer import merged_lora_state

    model, tok = load_model("tiny-random")  # its own copy: LoRA wraps the model it is given
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model, tok, TrainConfig(bf16=False, lr=1e-2, lora=True, lora_r=4, temperature=1.0))
    samples = rollout_samples(*trainer.policy_pair(), n=2)
    trainer.rl_backward(samples, LossConfig(), normalizer=64.0)
    trainer.optimizer_step()  # B is no longer zero: the adapters change the weights
    merged = trainer.full_state_dict()
    want = copy.deepcopy(trainer.model).merge_and_unload().state_dict()
    assert set(merged) == set(want) == set(plain)
    assert all(torch.allclose(merged[k], want[k], atol=1e-6) for k in want)
    assert any(not torch.equal(merged[k], plain[k]) for k in want)  # the update is in them
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    merged_lora_state(trainer.model)
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # nothing merged in place
