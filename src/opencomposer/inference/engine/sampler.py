"""``sample``: next tokens and their logprobs for a batch of rows, each with its own settings.

Logprob convention (what ``StepOutput.new_logprobs`` / ``Completion.logprobs`` hold):
``log_softmax(logits / T)[token]`` with T the request's temperature (T = 1 for greedy),
computed in fp32 from the model's logits, *before* top-k/top-p truncation. That is exactly
what the trainer computes (``train/loss.py``: ``log_softmax(logits.float() / temperature)``),
so importance ratios compare like with like. (With top_p = 1 and top_k = 0, the default
for RL rollouts, it is also the log-probability of the distribution sampled from.)

Sampling inverts each row's cumulative distribution at one uniform number (``draw``): a draw
from ``p``, with one random number a row where the exponential race ``argmax(p / E)`` took
one per vocabulary entry (SmolLM2's 49,152 at batch 8: 13 -> 3.5 ms a step on the 2-core
VM; the GPU graphs use the fused race of ``triton_sample.py``). Rows with a ``seed`` take
their numbers from a stream of their own (``uniforms``: counter-based, SplitMix64 of the seed
and a per-request count), so their output does not depend on what else is in the batch.

``top_logprobs = N`` (<= 20) also returns, per sampled token, the N most likely tokens and
their logprobs under the same convention (before truncation), most likely first.

Rows with no top-k/top-p, seed or top_logprobs are "plain": ``sample_plain`` samples them
with fixed-shape tensor ops only (temperatures and greedy flags as tensors), which is what
the decode CUDA graphs capture (``model_runner.py``), so such a step needs no sampling
kernels launched from Python.
"""

from __future__ import annotations

import numpy as np
import torch

from opencomposer.inference.engine.sequence import Sequence

TopLogprobs = list[tuple[int, float]]


def is_plain(seq: Sequence) -> bool:
    p = seq.params
    return p.top_k == 0 and p.top_p >= 1.0 and seq.seed is None and not p.top_logprobs


def plain_inputs(seqs: list[Sequence]) -> list[list[float]]:
    """[temperatures (1 for greedy), greedy flags (1.0 / 0.0)]: ``sample_plain``'s inputs."""
    return [[s.params.temperature if s.params.temperature > 0 else 1.0 for s in seqs],
            [float(s.params.temperature == 0) for s in seqs]]


def sample_plain(logits: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V], ``inputs`` [2, B] fp32 from ``plain_inputs`` -> [2, B] fp64:
    sampled token ids and their logprobs. Fixed shapes, no host sync (CUDA-graph safe)."""
    logits = logits.float()
    scaled = logits / inputs[0][:, None]
    weights = (scaled - scaled.max(dim=-1, keepdim=True).values).exp_()  # p up to a factor per row
    drawn = draw(weights, torch.rand(scaled.shape[0], dtype=torch.float64, device=scaled.device))
    tokens = torch.where(inputs[1] > 0.5, logits.argmax(dim=-1), drawn)
    chosen = scaled.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)
    return torch.stack([tokens.double(), chosen.double()])


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """``logits`` [B, V] (any float dtype) for ``seqs`` -> (token ids, logprobs, top logprobs),
    one per row (top logprobs: None for rows that did not ask for them)."""
    dev = logits.device
    if all(is_plain(s) for s in seqs):
        out = sample_plain(logits, _host(plain_inputs(seqs), dev, torch.float32)).tolist()  # one sync
        return [int(t) for t in out[0]], out[1], [None] * len(seqs)
    logits = logits.float()
    params = [s.params for s in seqs]
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    if all(t == 1.0 for t in temps):
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        logprobs = torch.log_softmax(logits / _host(temps, dev, torch.float32)[:, None], dim=-1)
    greedy = [p.temperature == 0 for p in params]
    if all(greedy):
        tokens = logits.argmax(dim=-1)
    else:
        probs = truncate(logprobs, params).exp()
        tokens = draw(probs, uniforms(seqs, 1, dev)[:, 0])
        if any(greedy):
            tokens = torch.where(_host(greedy, dev, torch.bool), logits.argmax(dim=-1), tokens)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    rows = [tokens.double()[None], chosen.double()[None]]
    top_n = max(p.top_logprobs for p in params)
    if top_n:
        values, ids = logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1)
        rows += [ids.double().T, values.double().T]
    out = torch.cat(rows).tolist()  # one device->host sync
    k = (len(out) - 2) // 2
    tops: list[TopLogprobs | None] = []
    for i, p in enumerate(params):
        n = min(p.top_logprobs, k)
        tops.append([(int(out[2 + j][i]), out[2 + k + j][i]) for j in range(n)] if p.top_logprobs else None)
    return [int(t) for t in out[0]], out[1], tops


_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of ``x`` + the golden gamma (uint64, wrapping): a bijection
    that scatters neighbouring inputs over all 64 bits."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def seeded_uniforms(seeds: list[int], starts: list[int], n: int) -> np.ndarray:
    """[len(seeds), n] fp64 in [0, 1): numbers ``starts[i]`` .. ``starts[i] + n - 1`` of seed
    ``seeds[i]``'s stream, SplitMix64(SplitMix64(seed) + count) in its top 53 bits. All rows at once
    in numpy, on the host: no torch call per row, each of which would let go of the GIL (and an RL
    rollout's engine thread must win it back from the episodes' threads every time)."""
    with np.errstate(over="ignore"):
        key = _splitmix(np.array(seeds, dtype=np.int64).astype(np.uint64))
        count = np.array(starts, dtype=np.uint64)[:, None] + np.arange(n, dtype=np.uint64)[None, :]
        bits = _splitmix(key[:, None] + count)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def uniforms(seqs: list[Sequence], n: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), n] uniform fp64 numbers in [0, 1); a row whose request has a ``seed`` takes the
    next ``n`` numbers of its own stream (``seeded_uniforms``; its output does not depend on the rest
    of the batch). They are made on the host for every seeded row at once and sent in one copy:
    a device generator per row cost two kernel launches a row, ~180 at an RL rollout's batch of 88,
    and a host generator per row one torch call a row."""
    seeded = [i for i, s in enumerate(seqs) if s.seed is not None]
    if not seeded:
        return torch.rand(len(seqs), n, dtype=torch.float64, device=device)
    rows = torch.from_numpy(seeded_uniforms([seqs[i].seed for i in seeded], [seqs[i].draws for i in seeded], n))
    for i in seeded:
        seqs[i].draws += n
    if len(seeded) == len(seqs):
        return rows.to(device, non_blocking=True)
    u = torch.rand(len(seqs), n, dtype=torch.float64, device=device)
    u.index_copy_(0, torch.tensor(seeded).to(device, non_blocking=True), rows.to(device, non_blocking=True))
    return u


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``weights`` [B, V] (>= 0, proportional to the probabilities) from
    a uniform ``u`` [B] in [0, 1): the first token whose cumulative weight passes ``u`` x the
    row's total (zero-weight tokens never). Summed in fp64: in fp32 a token of less than ~6e-8
    of the mass, late in the vocabulary, could not be drawn at all."""
    cdf = weights.double().cumsum_(-1)
    target = (u.double() * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=weights.shape[-1] - 1)


def race(weights: torch.Tensor, u=None) -> torch.Tensor:
    """One token per row of ``weights`` [B, V] (>= 0), distributed as ``draw``'s, by an
    exponential race: the argmax of ``w / E`` with ``E ~ Exp(1)`` drawn per token (zero-weight
    tokens never). Every token in parallel, so on a GPU it is a few fast kernels where
    ``draw``'s cumulative sum over 152k tokens is one slow scan a row (230 us on an H200);
    its random numbers come from the device generator (``u`` is ignored: ``draw``'s
    signature). Speculative decoding's graphs use it (``spec_graph.py``)."""
    w = weights.float()
    return torch.where(w > 0, w / torch.empty_like(w).exponential_(), -1.0).argmax(-1)


def _host(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def truncate(logprobs: torch.Tensor, params: list) -> torch.Tensor:
    """Set to -inf what top-k / top-p leave out (per row); rows with neither are untouched."""
    ks = [p.top_k for p in params]
    ps = [p.top_p for p in params]
    if all(k == 0 for k in ks) and all(p >= 1.0 for p in ps):
        return logprobs
    vocab = logprobs.shape[-1]
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logprobs.device)[None, :]
    k = _host([k if k > 0 else vocab for k in ks], logprobs.device, torch.long)[:, None]
    drop = ranks >= k
    p = _host(ps, logprobs.device, torch.float32)[:, None]
    probs = sorted_lp.masked_fill(drop, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
    drop |= before >= p  # keep the smallest prefix whose mass reaches top_p (the first always)
    sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
    return torch.empty_like(logprobs).scatter_(1, order, sorted_lp)
