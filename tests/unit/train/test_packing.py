"""Packed micro-batches (``train/micro_batches.py``, ``train/document_attention.py``) on a real
tiny-random model: a packed row's per-token losses and log-probs equal each sample's alone, and
a step's gradient equals the padded, whole-logits path's."""

from __future__ import annotations

import math
import platform

import pytest
import torch
from pydantic import ValidationError

from opencomposer.models import load_model
from opencomposer.train import TrainConfig, Trainer
from opencomposer.train.host_memory import return_freed_memory
from opencomposer.train.loss import LossConfig
from opencomposer.train.micro_batches import group_samples, shared_length
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


def scores_as_alone(trainer: Trainer, row, samples: list[Sample], temperature: float) -> None:
    """Every loss token of the packed ``row`` has the NLL and log-prob it has in its sample alone
    (the row's order is that of ``samples``)."""
    alone = [trainer._collate([s]) for s in samples]
    torch.testing.assert_close(trainer._nll(row)[0], torch.cat([trainer._nll(b)[0] for b in alone]),
                               rtol=1e-5, atol=1e-5)
    lp, _ = trainer._logprobs(trainer.model, row, temperature)
    torch.testing.assert_close(lp[0], torch.cat([trainer._logprobs(trainer.model, b, temperature)[0][0]
                                                 for b in alone]), rtol=1e-5, atol=1e-5)


def test_a_packed_rows_token_losses_equal_each_sample_alone(tiny):
    model, tok = tiny
    trainer = Trainer(model, tok, TrainConfig(bf16=False, logits_chunk_tokens=5))
    samples = _samples(model.config.vocab_size)
    with torch.no_grad():
        packed = trainer._collate(samples)
        assert packed.ids.shape == (1, sum(len(s) for s in samples)) and packed.attn is None
        scores_as_alone(trainer, packed, samples, 0.7)
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


def _sharing_samples(vocab: int) -> list[Sample]:
    """A root, two samples sharing 10 and 14 of its first tokens (the second's 14 equal the first's
    length, so its piece would go on by one from the first's: it must share one token less), and
    one sharing nothing."""
    g = torch.Generator().manual_seed(2)
    root = torch.randint(0, vocab, (30,), generator=g).tolist()

    def sample(prefix: int, n: int, first_loss: int, adv: float) -> Sample:
        ids = root[:prefix] + torch.randint(0, vocab, (n - prefix,), generator=g).tolist()
        if prefix < len(root) and ids[prefix] == root[prefix]:
            ids[prefix] = (ids[prefix] + 1) % vocab
        mask = [0] * first_loss + [int(i % 4 != 0) for i in range(first_loss, n)]
        return Sample(input_ids=ids, loss_mask=mask, old_logprobs=(-torch.rand(n, generator=g)).tolist(), advantage=adv)

    return [Sample(input_ids=root, loss_mask=[0] * 5 + [1] * 25, old_logprobs=[0.0] * 30, advantage=1.0),
            sample(10, 14, 11, -0.5), sample(25, 28, 15, 2.0), sample(0, 12, 3, 0.25)]


def test_shared_prefixes_are_laid_down_once_and_every_token_scores_as_alone(tiny):
    model, tok = tiny
    trainer = Trainer(model, tok, TrainConfig(bf16=False, logits_chunk_tokens=5))
    samples = _sharing_samples(model.config.vocab_size)
    with torch.no_grad():
        shared = trainer._collate(samples)
        # root whole, then 10 and 13 tokens shared (14 would read as the 14-token piece's continuation)
        assert shared.positions[0].tolist() == (list(range(30)) + list(range(10, 14)) + list(range(13, 28))
                                                + list(range(12)))
        assert shared.tokens == 30 + 14 + 28 + 12 and shared.computed == 30 + 4 + 15 + 12
        scores_as_alone(trainer, shared, samples, 1.0)
        unshared = Trainer(*load_model("tiny-random"), TrainConfig(bf16=False, share_prefixes=False))._collate(samples)
        assert unshared.computed == unshared.tokens == shared.tokens


@pytest.mark.parametrize("step", ["sft", "rl"])
def test_shared_prefixes_give_the_unshared_gradient(tiny, step):
    samples = _sharing_samples(tiny[0].config.vocab_size)
    plain = Trainer(*tiny, TrainConfig(bf16=False, share_prefixes=False, micro_batch_tokens=200))
    shared = Trainer(*load_model("tiny-random"), TrainConfig(bf16=False, micro_batch_tokens=200,
                                                             gradient_checkpointing=True))
    if step == "sft":
        m1, m2 = (t.sft_backward(samples, normalizer=50.0) for t in (plain, shared))
    else:  # the sampler's log-probs from these very weights: ratios near 1, nothing clipped
        with torch.no_grad():
            for s in samples:
                lp = plain._logprobs(plain.model, plain._collate([s]), 1.0)[0][0].tolist()
                s.old_logprobs = [0.0] + [lp.pop(0) if m else 0.0 for m in s.loss_mask[1:]]
        m1, m2 = (t.rl_backward(samples, LossConfig(), normalizer=50.0) for t in (plain, shared))
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5, abs=1e-7) and m1["tokens"] == m2["tokens"]
    g1, g2 = grads(plain.model), grads(shared.model)
    assert max(float(g.abs().max()) for g in g1.values()) > 1e-3  # a gradient worth comparing
    assert g1.keys() == g2.keys() and g1
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6, msg=n)


def test_a_row_counts_shared_samples_at_their_unshared_length_and_routes_share_nothing():
    prefix = list(range(2, 62))

    def s(n: int, routed: bool = False) -> Sample:
        ids = prefix + [100 + n] * (n - len(prefix))
        routes = torch.zeros((n - 1, 1, 1), dtype=torch.long) if routed else None
        return Sample(input_ids=ids, loss_mask=[0] * 61 + [1] * (n - 61), old_logprobs=[0.0] * n, routes=routes)

    batch = [s(90), s(80), s(70)]  # 90 + 20 + 10 with the 60 shared tokens laid down once
    assert [len(g) for g in group_samples(batch, budget=120, packed=True, share=True)] == [3]
    assert [len(g) for g in group_samples(batch, budget=120, packed=True)] == [1, 1, 1]
    routed = [s(90, True), s(80, True)]
    assert [len(g) for g in group_samples(routed, budget=120, packed=True, share=True)] == [1, 1]
    assert shared_length(routed[0], routed[1]) == 0 and shared_length(batch[0], batch[1]) == 60


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("layout", ["split", "shared"])
def test_sequence_level_importance_weights_are_per_sample_in_packed_rows(tiny, mode, layout):
    """``[loss] is_level = "sequence"``: each sample's loss tokens share one weight, the geometric
    mean of their p_trainer / p_sampler, whether the samples are padded rows or pieces of packed
    rows (split over two micro-batches, or sharing a prefix). Sampler log-probs are the trainer's
    shifted per sample so the weights are 4, 1, 1/4 (, 1)."""
    vocab = tiny[0].config.vocab_size
    samples = _samples(vocab) if layout == "split" else _sharing_samples(vocab)
    padded = Trainer(*tiny, TrainConfig(bf16=False, pack_sequences=False, micro_batch_tokens=200))
    packed = Trainer(*load_model("tiny-random"), TrainConfig(bf16=False, micro_batch_tokens=40 if layout == "split"
                                                             else 200))
    weights = [4.0, 1.0, 0.25, 1.0][:len(samples)]
    with torch.no_grad():
        for s, w in zip(samples, weights):
            lp = padded._logprobs(padded.model, padded._collate([s]), padded.cfg.logprob_temperature)[0][0].tolist()
            s.old_logprobs = [0.0] + [lp.pop(0) - math.log(w) if m else 0.0 for m in s.loss_mask[1:]]
    cfg = LossConfig(is_correction=mode, is_level="sequence", is_cap=2.0)
    m1, m2 = (t.rl_backward(samples, cfg, normalizer=50.0) for t in (padded, packed))
    assert len(padded._micro_batches(samples)) == 1
    assert len(packed._micro_batches(samples)) == (2 if layout == "split" else 1)
    if layout == "shared":
        assert packed._collate(samples).computed < packed._collate(samples).tokens  # a prefix was shared

    # the ratio is to the trainer's own log-probs (1), so the loss is -sum(w * A * loss tokens) / 50
    kept = [min(w, 2.0) if mode == "truncate" else (w if 0.5 <= w <= 2.0 else 0.0) for w in weights]
    want = -sum(k * s.advantage * s.loss_tokens for k, s in zip(kept, samples)) / 50.0
    corrected = sum(w > 2.0 or (mode == "mask" and w < 0.5) for w in weights) / len(samples)
    for m in (m1, m2):
        assert m["loss"] == pytest.approx(want, rel=1e-4)
        assert m["is_corrected_fraction"] == pytest.approx(corrected) and m["sequences"] == len(samples)
    g1, g2 = grads(padded.model), grads(packed.model)
    assert g1.keys() == g2.keys() and g1
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6, msg=n)
