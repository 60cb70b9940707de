"""Packed micro-batches (``train/micro_batches.py``, ``train/document_attention.py``) on a real
tiny-random model: a packed row's per-token losses and log-probs equal each sample's alone, and
a step's gradient equals the padded, whole-logits path's."""

from __future__ import annotations

import platform

import pytest
import torch
from pydantic import ValidationError

from opencomposer.models import load_model
from opencomposer.train import TrainConfig, Trainer
from opencomposer.train.host_memory import return_freed_memory
from opencomposer.train.loss import LossConfig
from opencomposer.train.micro_batches import group_samples
from opencomposer.train.samples import Sample

from testkit.train_data import grads


def _samples(vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n, adv in ((23, 0.5), (9, -1.0), (31, 2.0)):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        mask = [0] * 3 + [int(i % 3 != 0) for i in range(3, n)]
        old = (-torch.rand(n, generator=g)).tolist()
        out.append(Sample(input_ids=ids, loss_mask=mask, old_logprobs=old, advantage=adv))
    return out


def test_a_packed_rows_token_losses_equal_each_sample_alone(tiny):
    model, tok = tiny
    trainer = Trainer(model, tok, TrainConfig(bf16=False, logits_chunk_tokens=5))
    samples = _samples(model.config.vocab_size)
    with torch.no_grad():
        packed = trainer._collate(samples)
        assert packed.ids.shape == (1, sum(len(s) for s in samples)) and packed.attn is None
        alone = [trainer._collate([s]) for s in samples]
        torch.testing.assert_close(trainer._nll(packed)[0], torch.cat([trainer._nll(b)[0] for b in alone]),
                                   rtol=1e-5, atol=1e-5)
        lp, ent = trainer._logprobs(model, packed, 0.7)
        torch.testing.assert_close(lp[0], torch.cat([trainer._logprobs(model, b, 0.7)[0][0] for b in alone]),
                                   rtol=1e-5, atol=1e-5)
        assert packed.adv[0].tolist() == [s.advantage for s in samples for m in s.loss_mask[1:] if m]
    # and the same as a plain forward of each sample with the model's own attention
    with torch.no_grad():
        plain = []
        for s in samples:
            logp = model(input_ids=torch.tensor([s.input_ids])).logits[0, :-1].log_softmax(-1)
            plain += [-float(logp[t - 1, s.input_ids[t]]) for t in range(1, len(s)) if s.loss_mask[t]]
    torch.testing.assert_close(trainer._nll(packed)[0], torch.tensor(plain), rtol=1e-5, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # the packed forward's attention is undone after it


@pytest.mark.parametrize("step", ["sft", "rl"])
def test_packed_chunked_steps_give_the_padded_whole_logits_gradient(tiny, step):
    samples = _samples(tiny[0].config.vocab_size)
    old = Trainer(*tiny, TrainConfig(bf16=False, pack_sequences=False, logits_chunk_tokens=0, micro_batch_tokens=40))
    new = Trainer(*load_model("tiny-random"), TrainConfig(bf16=False, micro_batch_tokens=40, logits_chunk_tokens=4,
                                                          gradient_checkpointing=True))
    if step == "sft":
        m1, m2 = (t.sft_backward(samples, normalizer=50.0) for t in (old, new))
    else:
        m1, m2 = (t.rl_backward(samples, LossConfig(), normalizer=50.0) for t in (old, new))
        assert m1["entropy"] == pytest.approx(m2["entropy"], rel=1e-5)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5, abs=1e-7) and m1["tokens"] == m2["tokens"]
    assert len(old._micro_batches(samples)) == 3 and len(new._micro_batches(samples)) == 2
    g1, g2 = grads(old.model), grads(new.model)
    assert g1.keys() == g2.keys() and g1
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6, msg=n)


def test_packing_fills_rows_first_fit_and_a_long_sample_goes_alone():
    def s(n):
        return Sample(input_ids=[1] * n, loss_mask=[0] + [1] * (n - 1), old_logprobs=[0.0] * n)

    groups = group_samples([s(n) for n in (30, 70, 50, 120, 20, 10)], budget=100, packed=True)
    assert [[len(x) for x in g] for g in groups] == [[120], [70, 30], [50, 20, 10]]
    padded = group_samples([s(n) for n in (30, 70, 50, 20)], budget=100, packed=False)
    assert [[len(x) for x in g] for g in padded] == [[70], [50, 30], [20]]


def test_bad_batching_settings_name_the_field():
    with pytest.raises(ValidationError, match="logits_chunk_tokens"):
        TrainConfig(logits_chunk_tokens=-1)
    with pytest.raises(ValidationError, match="pack_sequences"):
        TrainConfig(pack_sequences="sometimes")
    with pytest.raises(ValidationError, match="gradient_checkpointing"):
        TrainConfig(gradient_checkpointing="sometimes")
    with pytest.raises(ValidationError, match="return_host_memory"):
        TrainConfig(return_host_memory="sometimes")


def test_checkpointing_is_on_by_default_on_the_cpu_and_freed_memory_goes_back(tiny):
    def checkpointed(trainer):
        return any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())

    assert checkpointed(Trainer(*tiny, TrainConfig(bf16=False)))
    assert not checkpointed(Trainer(*load_model("tiny-random"), TrainConfig(bf16=False, gradient_checkpointing=False)))
    if platform.libc_ver()[0] == "glibc":
        assert return_freed_memory() is True


def test_a_mixture_of_experts_model_is_not_checkpointed():
    """Router replay's hooks live for the forward only, so a recomputed layer would route afresh:
    'auto' leaves MoE models alone and an explicit true is refused naming the setting."""
    moe = load_model("tiny-random-moe")
    trainer = Trainer(*moe, TrainConfig(bf16=False))
    assert not any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())
    with pytest.raises(ValueError, match="gradient_checkpointing=true with a mixture-of-experts"):
        Trainer(*load_model("tiny-random-moe"), TrainConfig(bf16=False, gradient_checkpointing=True))
