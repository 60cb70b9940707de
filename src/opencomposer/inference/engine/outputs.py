"""What a request reports: a ``StepOutput`` each step, a ``Completion`` once it finished, and the
stop rules that finish it (``Engine`` calls these; ``core.py``).

    reason = stop_reason(seq, eos_ids, tokenizer, max_model_len)   # "stop" | "length" | None
    seq.text = completion_text(seq, reason, eos_ids, tokenizer)
    c = Completion.of(seq)

Meaning of the outputs:

* ``logprobs``: ``log_softmax(logits / T)[token]`` in fp32 (T = 1 for greedy), before
  top-k/top-p truncation: what the trainer's forward pass computes (see ``sampler.py``).
* ``policy_versions``: the ``policy_version`` of the weights that produced each token.
  ``Engine.update_weights(state_dict, version)`` waits for the step in flight (dropping a step
  launched ahead, ``run_ahead.py``), copies the weights in place, and the next step runs with
  them; running sequences continue (their cached K/V stays as the old weights computed it,
  as in PipelineRL-style in-flight updates).
  The prefix cache is invalidated: requests admitted later never reuse old-weight K/V.
* ``token_ids`` end with the stop token when a turn ended on one (the model must learn
  to emit it), and include the token that completed a stop string; ``text`` is the
  decoding without the stop token and cut before the stop string.
* ``cached_prompt_tokens``: prompt tokens whose K/V came from the prefix cache.
* ``top_logprobs`` (when ``SamplingParams.top_logprobs = N``): per generated token the N
  most likely tokens and their logprobs, same convention as ``logprobs``.

Test: ``pytest tests/unit/inference/test_engine.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from opencomposer.inference.engine.sequence import SamplingParams, Sequence


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token, when asked for


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    text: str
    finish_reason: str
    cached_prompt_tokens: int
    # per generated token: [(token id, logprob), ...] most likely first (SamplingParams.top_logprobs)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # MoE models: the experts each token of prompt + completion was routed to, [n, sparse layers, k]
    # int16, for the n tokens the model ran (all but the last sampled one); None for a dense model
    routes: torch.Tensor | None = None

    @classmethod
    def of(cls, seq: Sequence) -> Completion:
        """The result of the finished sequence ``seq``."""
        return cls(
            request_id=seq.request_id, prompt_token_ids=seq.token_ids[:seq.num_prompt],
            token_ids=seq.completion_ids, logprobs=list(seq.logprobs), policy_versions=list(seq.versions),
            text=seq.text, finish_reason=seq.finish_reason or "abort",
            cached_prompt_tokens=max(seq.cached_prompt_tokens, 0), top_logprobs=list(seq.top_logprobs),
            routes=None if seq.routes is None else seq.routes.cpu())  # the only host sync for them


def stop_reason(seq: Sequence, eos_ids: frozenset[int], tokenizer: Any, max_model_len: int) -> str | None:
    """Why ``seq`` stops after its last token: "stop" (an end-of-turn or stop token, or a stop
    string in the decoded tail; end-of-turn ids not under ``ignore_eos``), "length" (``max_tokens``
    or ``max_model_len``), else None."""
    p = seq.params
    if _ends_turn(seq.token_ids[-1], p, eos_ids):
        return "stop"
    if p.stop and tokenizer is not None:
        window = max(len(s) for s in p.stop) + 8  # tokens: each one is at least a char, mostly
        tail = tokenizer.decode(seq.completion_ids[-window:], skip_special_tokens=False)
        if any(s in tail for s in p.stop):
            return "stop"
    if seq.num_generated >= p.max_tokens or len(seq) >= max_model_len:
        return "length"
    return None


def _ends_turn(token: int, p: SamplingParams, eos_ids: frozenset[int]) -> bool:
    return token in p.stop_token_ids or (token in eos_ids and not p.ignore_eos)


def completion_text(seq: Sequence, reason: str, eos_ids: frozenset[int], tokenizer: Any) -> str:
    """The finished ``seq``'s decoded completion, without its stop token and cut before the
    first stop string ("" without a tokenizer)."""
    if tokenizer is None:
        return ""
    ids = seq.completion_ids
    if reason == "stop" and ids and _ends_turn(ids[-1], seq.params, eos_ids):
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    cuts = [text.find(s) for s in seq.params.stop if s in text]
    return text[:min(cuts)] if cuts else text
