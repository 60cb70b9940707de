"""``SamplingParams`` (what a request asks for) and ``Sequence`` (one request's state in the engine).

A sequence's ``token_ids`` are its prompt followed by what it generated so far;
``num_computed`` of them have their K/V in the cache. The scheduler moves it
waiting -> running -> finished (or back to waiting when preempted); the block manager
owns ``block_table``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop: tuple[str, ...] = ()  # stop strings, matched on decoded text; not part of the returned text
    stop_token_ids: tuple[int, ...] = ()  # in addition to the tokenizer's/model's end-of-turn ids
    seed: int | None = None
    top_logprobs: int = 0  # also return the N most likely tokens' logprobs per sampled token (N <= 20)
    ignore_eos: bool = False  # go on past the end-of-turn ids to max_tokens (stop_token_ids and stop still end it)

    def check(self) -> None:
        bad = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad.append(f"max_tokens={self.max_tokens!r} (an int >= 1)")
        if not self.temperature >= 0:
            bad.append(f"temperature={self.temperature!r} (>= 0, 0 = greedy)")
        if not 0 < self.top_p <= 1:
            bad.append(f"top_p={self.top_p!r} (in (0, 1])")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad.append(f"top_k={self.top_k!r} (an int >= 0, 0 = off)")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**63):
            bad.append(f"seed={self.seed!r} (an int in [-2**63, 2**63), or None)")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            bad.append(f"stop={self.stop!r} (a tuple of non-empty strings)")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad.append(f"top_logprobs={self.top_logprobs!r} (an int in [0, {MAX_TOP_LOGPROBS}])")
        if not isinstance(self.ignore_eos, bool):
            bad.append(f"ignore_eos={self.ignore_eos!r} (True or False)")
        if bad:
            raise ValueError("bad SamplingParams: " + "; ".join(bad))


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, device: torch.device | None = None):
        self.request_id = request_id
        self.token_ids = list(prompt)
        self.num_prompt = len(prompt)
        self.params = params
        self.status = Status.WAITING
        self.num_computed = 0          # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of the leading full, computed blocks
        self.cache_epoch = -1          # prefix-cache epoch its blocks were computed under
        self.cached_prompt_tokens = -1  # from the prefix cache at first admission (-1: not yet admitted)
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []  # per generated token, when asked for
        self.versions: list[int] = []
        # speculative decoding (``speculate.py``): tokens drafted after the last one, and the
        # head's distributions [k, V] they were drawn from (None for a greedy request)
        self.draft: list[int] = []
        self.draft_q: torch.Tensor | None = None
        self.routes: torch.Tensor | None = None  # MoE: set when finished (``moe.read_routes``)
        self.finish_reason: str | None = None
        self.text = ""                 # final text, set when finished
        # a seeded request's random numbers: the ``draws``-th, ``draws + 1``-th, ... of its seed's
        # counter-based stream (``sampler.uniforms``, on the host whatever the engine's device;
        # ``device`` is kept for callers, unused)
        self.seed: int | None = params.seed
        self.draws = 0

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    def __len__(self) -> int:
        return len(self.token_ids)
