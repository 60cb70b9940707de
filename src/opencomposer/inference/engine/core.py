"""``Engine``: the rollout and serving engine (continuous batching over a paged KV cache).

    from opencomposer.inference.engine.core import Engine, SamplingParams
    engine = Engine.from_name("tiny-random")            # or Engine(hf_model, tokenizer, ...)
    [c] = engine.generate([prompt_ids], SamplingParams(max_tokens=32, temperature=0))
    c.token_ids, c.logprobs, c.policy_versions, c.text, c.finish_reason, c.cached_prompt_tokens

Streaming / serving: ``add_request`` then call ``step()`` in a loop (one thread owns the
engine; ``step`` is not thread-safe, ``update_weights`` is). Each step is schedule ->
run the model -> sample -> post-process, for all running sequences at once; finished
sequences leave the batch and waiting ones join it between any two steps. ``generate``
steps the whole engine until its own requests finish: use it when you own the engine
(tests, ``EnginePolicy``), not beside a server loop that also steps it.

Run-ahead decode (``run_ahead``, on by default wherever decode graphs exist): a decode step
whose rows are all sampled inside the graph is launched, its tokens are queued for an
asynchronous copy to the host, and -- when the next step is bound to be the same batch
one position further -- that next step is launched at once from the tokens still on the
device, before ``step()`` waits for and post-processes the first. The host's per-step
work (scheduling, reading results, stop checks) then overlaps the GPU's next step instead
of leaving it idle (as vLLM's async scheduling and SGLang's overlap scheduler do). The step
left in flight is post-processed by the next ``step()``. It is launched only when it
is safe: no request waiting that the scheduler could admit, every sequence of the batch
still running, two tokens of ``max_tokens`` budget left, and a free block for any
sequence whose next position starts one (run-ahead never preempts). A sequence that
finishes meanwhile (stop token or string, abort) has its row of the step in flight
dropped: that step wrote K/V only for the token the sequence really produced, into a
block it still owned, and no block is published for the prefix cache before its K/V is
computed. ``update_weights`` drops the step in flight (it ran with the old weights) and the
next step recomputes it with the new ones, so outputs, logprobs and policy versions are
exactly what they are without run-ahead.

Meaning of the outputs:

* ``logprobs``: ``log_softmax(logits / T)[token]`` in fp32 (T = 1 for greedy), before
  top-k/top-p truncation: what the trainer's forward pass computes (see ``sampler.py``).
* ``policy_versions``: the ``policy_version`` of the weights that produced each token.
  ``update_weights(state_dict, version)`` waits for the step in flight (dropping a step
  launched ahead, see above), copies the weights in place, and the next step runs with
  them; running sequences continue (their cached K/V stays as the old weights computed it,
  as in PipelineRL-style in-flight updates).
  The prefix cache is invalidated: requests admitted later never reuse old-weight K/V.
* ``token_ids`` end with the stop token when a turn ended on one (the model must learn
  to emit it), and include the token that completed a stop string; ``text`` is the
  decoding without the stop token and cut before the stop string.
* ``cached_prompt_tokens``: prompt tokens whose K/V came from the prefix cache.
* ``top_logprobs`` (when ``SamplingParams.top_logprobs = N``): per generated token the N
  most likely tokens and their logprobs, same convention as ``logprobs``.

Options: ``kernels="triton"`` (default on CUDA) uses the fused Triton kernels of
``triton_kernels.py``; ``"torch"`` is the portable path (the only one on CPU).
``cuda_graphs`` captures decode steps on CUDA (sampling included). ``gemv`` (Triton, CUDA):
batch-1 decode with the fused small-batch projections of ``triton_gemv.py``; None (default)
times them against cuBLAS at capture and keeps the faster. ``kv_blocks`` defaults to 80% of free GPU
memory on CUDA (capped at twice what ``max_num_seqs`` full-length sequences need) and
to at most 1 GiB on CPU. ``stats()`` reports blocks (total / used / cached; used is 0
when idle, so a leak shows), running / waiting, prefix-cache hit tokens, preemptions,
tokens and seconds spent in prefill and decode steps, the policy version, and on CUDA which
graphs exist (decode batch sizes, prefill token buckets) and the batch-1 GEMV plan; with
run-ahead, the steps launched ahead and the rows of them dropped (``run_ahead_steps``,
``run_ahead_discarded_rows``: neither counts as generated tokens; ``steps`` counts steps
whose results were used). ``cuda_graphs="eager"`` runs the decode graphs' bodies eagerly on
their static buffers (CPU tests of the graph and run-ahead paths).

Speculative decoding: ``draft`` (an ``MTPHead`` or its directory, ``models/mtp.py``) with
``num_draft`` drafted tokens a step; decode batches of up to ``spec_max_batch`` sequences then
verify each sequence's drafts in one step and keep what rejection sampling accepts
(``speculate.py``): several tokens a step, each reported in one ``StepOutput`` per sequence,
outputs distributed exactly as without; ``stats()`` adds ``spec_*`` counts. No run-ahead then.

Test: ``pytest tests/unit/inference``; GPU: ``pytest tests/gpu/test_engine_cuda.py``;
benchmark: ``opencomposer bench engine``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from opencomposer.inference.engine.block_manager import BlockManager
from opencomposer.inference.engine.model_runner import ModelRunner
from opencomposer.inference.models.transformer import DecoderLM, from_hf_model
from opencomposer.inference.models.moe import (
    grouped_mm_capturable,
    grouped_mm_works,
    read_routes,
)
from opencomposer.inference.engine.prefill_layout import prefill_buckets
from opencomposer.inference.engine.run_ahead import Launch
from opencomposer.inference.engine.sampler import sample
from opencomposer.inference.engine.scheduler import Scheduler
from opencomposer.inference.engine.sequence import SamplingParams, Sequence, Status

__all__ = ["Completion", "Engine", "SamplingParams", "StepOutput"]

KEEP_FINISHED = 4096  # finished requests kept for ``completion()`` (oldest dropped first)


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


@dataclass
class _InFlight:
    """A decode step launched on the device whose sampled tokens have not been read."""

    seqs: list[Sequence]  # its rows
    launch: Launch
    version: int  # policy version of the weights it runs with


class Engine:
    def __init__(self, model: Any, tokenizer: Any = None, *, max_num_seqs: int = 64, max_model_len: int | None = None,
                 kv_blocks: int | None = None, block_size: int = 16, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, max_num_batched_tokens: int | None = None,
                 cuda_graphs: bool | str = True, kernels: str | None = None,
                 kv_memory_fraction: float = 0.8, policy_version: int = 0, gemv: bool | None = None,
                 pdl: bool | None = None, run_ahead: bool | None = None, draft: Any = None, num_draft: int = 3,
                 spec_max_batch: int = 1):
        if max_num_seqs < 1 or block_size < 1:
            raise ValueError(f"need max_num_seqs >= 1 and block_size >= 1; got {max_num_seqs}, {block_size}")
        if not 0 < kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction={kv_memory_fraction}: expected a fraction of free GPU memory in (0, 1]")
        if isinstance(model, DecoderLM):
            self.model = model if device is None and dtype is None else model.to(device=device, dtype=dtype)
            eos_source = SimpleNamespace(generation_config=None)
        else:  # a Hugging Face *ForCausalLM: copy its weights into the engine's own model
            self.model = from_hf_model(model, device=device, dtype=dtype)
            eos_source = model
        self.model.eval()
        self.tokenizer = tokenizer
        self.eos_ids = _eos_ids(eos_source, tokenizer)
        cfg = self.model.cfg
        self.device = next(self.model.parameters()).device
        self.max_model_len = max_model_len or min(cfg.max_position_embeddings, 4096)
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        self.max_num_seqs = max_num_seqs
        blocks_per_seq = -(-self.max_model_len // block_size)
        given_blocks = kv_blocks is not None
        if kv_blocks is None:
            kv_blocks = self._default_kv_blocks(blocks_per_seq, block_size, kv_memory_fraction)
        if kv_blocks < blocks_per_seq:
            raise ValueError(f"kv_blocks={kv_blocks} cannot hold one sequence of max_model_len={self.max_model_len} "
                             f"({blocks_per_seq} blocks of {block_size})")
        self.blocks = BlockManager(kv_blocks, block_size)
        budget = max_num_batched_tokens or max(2048, min(self.max_model_len, 8192))
        self.scheduler = Scheduler(self.blocks, max_num_seqs, budget)
        pow2 = cfg.head_dim & (cfg.head_dim - 1) == 0
        if cfg.sparse_layers:  # MoE: grouped GEMMs where this build runs them, else a loop (``moe.py``)
            model_dtype = next(self.model.parameters()).dtype
            grouped = grouped_mm_works(self.device, model_dtype)
            self.model.use_grouped_mm(grouped)
            gemv = False  # the batch-1 GEMV plan is for dense MLPs
            if cuda_graphs is True and self.device.type == "cuda" and not (
                    grouped and grouped_mm_capturable(self.device, model_dtype)):
                cuda_graphs = False  # the experts' loop (or grouped GEMMs' fallback) syncs with the host
        kernels = kernels or ("triton" if self.device.type == "cuda" and pow2 and _has_triton() else "torch")
        if kernels not in ("torch", "triton") or (kernels == "triton" and self.device.type != "cuda"):
            raise ValueError(f"kernels={kernels!r}: expected 'torch', or 'triton' on a CUDA device")
        graph_rows = max_num_seqs
        if draft is not None:  # a speculative step verifies k + 1 rows a sequence in a decode graph (spec_graph.py)
            from opencomposer.inference.engine.speculate import check_settings

            check_settings(num_draft, spec_max_batch)
            graph_rows = max(max_num_seqs, spec_max_batch * (num_draft + 1))
        try:
            self.runner = ModelRunner(self.model, kv_blocks, block_size, graph_rows, self.max_model_len,
                                      cuda_graphs=cuda_graphs, triton=kernels == "triton", gemv=gemv, pdl=pdl,
                                      max_num_batched_tokens=budget)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
            if not _out_of_memory(e):
                raise
            source = "kv_blocks as given" if given_blocks else f"kv_memory_fraction={kv_memory_fraction} of free memory"
            raise ValueError(  # settings the GPU cannot hold, as the other limits checked here
                f"out of GPU memory building the engine: a KV cache of {kv_blocks} blocks "
                f"({kv_blocks * self.kv_block_bytes(block_size) / 2**30:.2f} GiB, {source}) and the CUDA graphs (decode up to "
                f"max_num_seqs={max_num_seqs} rows, prefill steps up to {prefill_buckets(budget)[-1]} "
                f"tokens) do not fit. Lower kv_memory_fraction or kv_blocks, max_num_batched_tokens or "
                f"max_num_seqs, or pass cuda_graphs=False"
            ) from e
        self.speculator = None
        if draft is not None:  # an MTPHead or its directory: speculative decoding (``speculate.py``)
            from opencomposer.inference.engine.speculate import Speculator

            if run_ahead:
                raise ValueError("run_ahead=True and draft=: speculative decode steps are not launched ahead")
            self.speculator, run_ahead = Speculator(self.model, draft, num_draft, spec_max_batch), False
            self.speculator.attach(self.runner)
        self.run_ahead = bool(self.runner.graphs) if run_ahead is None else bool(run_ahead)
        if self.run_ahead and not self.runner.graphs:
            raise ValueError("run_ahead=True needs decode graphs: cuda_graphs=True on a CUDA device, "
                             "or cuda_graphs='eager'")
        self._inflight: _InFlight | None = None  # a decode step launched ahead, results not read yet
        self.policy_version = policy_version
        self._seqs: dict[str, Sequence] = {}
        self._finished: OrderedDict[str, Sequence] = OrderedDict()
        self._aborted: list[Sequence] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()  # held by step() and edit_weights()
        # a turnstile: an edit waiting for the lock holds it, so the stepping thread (which
        # passes it before each step) cannot take the lock again first
        self._turn = threading.Lock()
        self._counts = {"prompt_tokens": 0, "prefill_tokens_computed": 0, "generated_tokens": 0, "steps": 0,
                        "weight_updates": 0, "prefill_seconds": 0.0, "decode_seconds": 0.0,
                        "run_ahead_steps": 0, "run_ahead_discarded_rows": 0}

    @classmethod
    def from_name(cls, name_or_path: str, **kw: Any) -> Engine:
        """Load with ``opencomposer.models.registry.load_model`` (smollm2-135m, tiny-random, a
        local HF dir, a hub id) and build an engine; ``device``/``dtype`` go to both."""
        from opencomposer.models.registry import load_model

        device = kw.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = kw.get("dtype") or torch.float32
        hf, tok = load_model(name_or_path, dtype=dtype, device="cpu")
        kw = {**kw, "device": device, "dtype": dtype}
        return cls(hf, tok, **kw)

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        params.check()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("prompt_token_ids is empty; a request needs at least one prompt token")
        vocab = self.model.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{len(prompt) + params.max_tokens} exceeds max_model_len={self.max_model_len}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise ValueError(f"request_id {rid!r} is already in use")
        seq = Sequence(rid, prompt, params, device=self.device)
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        self._counts["prompt_tokens"] += len(prompt)
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; the next ``step`` reports it finished with
        ``finish_reason="abort"``. Unknown or already finished ids are ignored."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is Status.FINISHED:
            return
        self._finish(seq, "abort")
        self._aborted.append(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or self._inflight is not None

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[StepOutput]:
        with self._turn:  # an in-flight weight update waiting for the lock goes first
            pass
        with self._lock:
            outputs = [StepOutput(s.request_id, [], [], True, "abort") for s in self._aborted]
            self._aborted.clear()
            t0 = time.perf_counter()
            launched, self._inflight = self._inflight, None
            if launched is None:
                batch = self.scheduler.schedule()
                if batch is None:
                    return outputs
                if self.speculator is not None and batch.decode:
                    if self.speculator.wants(batch.seqs):
                        self._speculative_step(batch, t0, outputs)
                        return outputs
                    self.speculator.forget(batch.seqs)  # a plain step moves them past their drafts
                launch = self.runner.launch_decode(batch) if self.run_ahead and batch.decode else None
                if launch is None:
                    self._step_now(batch, t0, outputs)
                    return outputs
                launched = _InFlight(batch.seqs, launch, self.policy_version)
            if self._may_run_ahead(launched.seqs):
                self._inflight = self._launch_ahead(launched)
            tokens, logprobs = launched.launch.wait()
            self._counts["decode_seconds"] += time.perf_counter() - t0
            self._counts["steps"] += 1
            for seq, tok, lp in zip(launched.seqs, tokens, logprobs):
                if seq.status is not Status.RUNNING:  # finished (or aborted) after this step was launched
                    self._counts["run_ahead_discarded_rows"] += 1
                    continue
                seq.num_computed += 1
                self.blocks.publish(seq)
                self._append(seq, tok, lp, None, launched.version, outputs)
            if self._inflight is not None and all(s.status is not Status.RUNNING for s in self._inflight.seqs):
                self._drop_inflight()  # every row of it was for a sequence that just finished
            return outputs

    def _step_now(self, batch, t0: float, outputs: list[StepOutput]) -> None:
        """One step run to its results: prefill, and decode steps that cannot run ahead."""
        try:
            logits, sampled = self.runner.run(batch)
        except BaseException:
            # the scheduler published this step's blocks before computing them (scheduler.py)
            self.blocks.invalidate()
            raise
        sampling = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        if sampled is not None:  # sampled inside the decode graph (plain rows only)
            both = sampled.tolist()
            tokens, logprobs, tops = [int(t) for t in both[0]], both[1], [None] * len(sampling)
        elif sampling:
            tokens, logprobs, tops = sample(logits, sampling)
        else:
            tokens, logprobs, tops = [], [], []
        if not sampling and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # sampling's .tolist() syncs otherwise
        # wall time of the step up to its results (which wait for the device)
        self._counts["decode_seconds" if batch.decode else "prefill_seconds"] += time.perf_counter() - t0
        self._counts["steps"] += 1
        for seq, n in zip(batch.seqs, batch.chunks):
            seq.num_computed += n
            if not batch.decode:
                self._counts["prefill_tokens_computed"] += n
            self.blocks.publish(seq)
        for seq, tok, lp, top in zip(sampling, tokens, logprobs, tops):
            self._append(seq, tok, lp, top, self.policy_version, outputs)

    def _speculative_step(self, batch, t0: float, outputs: list[StepOutput]) -> None:
        """A decode step that verifies drafted tokens (``speculate.py``): each sequence gains
        its kept drafts and one sampled token, reported as one ``StepOutput``."""
        try:
            results = self.speculator.run(self.runner, self.blocks, batch, self.max_model_len)
        except BaseException:
            self.blocks.invalidate()
            raise
        self._counts["decode_seconds"] += time.perf_counter() - t0
        self._counts["steps"] += 1
        for seq, (tokens, logprobs, tops) in zip(batch.seqs, results):
            self._append(seq, tokens, logprobs, tops, self.policy_version, outputs, computed=True)

    def _append(self, seq: Sequence, tok, lp, top, version: int, outputs: list[StepOutput],
                computed: bool = False) -> None:
        """Add sampled tokens to ``seq`` (one, or a list: a speculative step's kept drafts and its
        sampled token), finish it if it stops (the tokens after a stop are dropped), and report
        them in one ``StepOutput``. ``computed``: each token but the last has its K/V in the cache
        already, as has the token before the first (a speculative step computed them)."""
        toks, lps, tops = (tok, lp, top) if isinstance(tok, list) else ([tok], [lp], [top])
        reason, n = None, 0
        for t, p, tp in zip(toks, lps, tops):
            if computed:  # the token before this one (last sampled, then each kept draft)
                seq.num_computed += 1
                self.blocks.publish(seq)
            seq.token_ids.append(t)
            seq.logprobs.append(p)
            if tp is not None:
                seq.top_logprobs.append(tp)
            seq.versions.append(version)
            self._counts["generated_tokens"] += 1
            n += 1
            reason = self._check_stop(seq)
            if reason:
                self._finish(seq, reason)
                break
        outputs.append(StepOutput(seq.request_id, toks[:n], lps[:n], reason is not None, reason,
                                  tops[:n] if tops[0] is not None else None))

    # ------------------------------------------------------------------ run-ahead

    def _may_run_ahead(self, seqs: list[Sequence]) -> bool:
        """Can the step after the one just launched for ``seqs`` start before its tokens are
        known? Only if the next step would be the same decode batch anyway and nobody can
        need preempting for it."""
        sch = self.scheduler
        if sch.waiting and len(sch.running) < sch.max_num_seqs:
            return False  # the next schedule() may admit a waiting request
        if len(sch.running) != len(seqs) or any(s.status is not Status.RUNNING for s in seqs):
            return False
        bs = self.blocks.block_size
        new_blocks = 0
        for s in seqs:
            # the launched step makes token num_generated + 1; the next one, + 2, at position len(s)
            if s.num_generated + 2 > s.params.max_tokens or len(s) + 2 > self.max_model_len:
                return False
            new_blocks += len(s) + 1 > len(s.block_table) * bs
        return new_blocks <= self.blocks.num_free

    def _launch_ahead(self, launched: _InFlight) -> _InFlight:
        bs = self.blocks.block_size
        new_blocks = []
        for row, s in enumerate(launched.seqs):
            if len(s) + 1 > len(s.block_table) * bs:  # position len(s) starts a block
                self.blocks.append_slot(s, len(s) + 1)
                new_blocks.append((row, len(s.block_table) - 1, s.block_table[-1]))
        self._counts["run_ahead_steps"] += 1
        return _InFlight(launched.seqs, self.runner.launch_next(launched.launch, new_blocks), self.policy_version)

    def _drop_inflight(self) -> None:
        """Wait for the step launched ahead and throw its results away."""
        t0 = time.perf_counter()
        self._inflight.launch.wait()
        self._counts["decode_seconds"] += time.perf_counter() - t0
        self._counts["run_ahead_discarded_rows"] += len(self._inflight.seqs)
        self._inflight = None

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Run ``prompts`` to completion (stepping the engine) and return them in order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        pending = set(rids)
        while pending:
            if not self.has_unfinished():
                raise RuntimeError(f"engine idle with {len(pending)} requests unfinished")
            for out in self.step():
                if out.finished:
                    pending.discard(out.request_id)
        return [self.completion(r) for r in rids]

    def completion(self, request_id: str) -> Completion:
        """The finished request's result (removed from the engine once read)."""
        seq = self._finished.pop(request_id, None)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not finished or was already read")
        self._seqs.pop(request_id, None)
        return Completion(
            request_id=seq.request_id, prompt_token_ids=seq.token_ids[:seq.num_prompt],
            token_ids=seq.completion_ids, logprobs=list(seq.logprobs), policy_versions=list(seq.versions),
            text=seq.text, finish_reason=seq.finish_reason or "abort",
            cached_prompt_tokens=max(seq.cached_prompt_tokens, 0), top_logprobs=list(seq.top_logprobs),
            routes=None if seq.routes is None else seq.routes.cpu())  # the only host sync for them

    # ------------------------------------------------------------------ weights

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights (HF parameter names; a subset is fine) between two steps."""
        targets = self.model.hf_targets({name: t.shape for name, t in state_dict.items()}, partial=True)
        self.edit_weights(lambda: self.model.write_hf(targets, state_dict), version)

    def weight_views(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """The tensors holding these HF-named weights (checked: ``hf_targets``), to edit in
        place inside ``edit_weights``."""
        return self.model.hf_targets(shapes, partial=True)

    def edit_weights(self, edit: Callable[[], None], version: int) -> None:
        """Run ``edit`` (which changes weights in place) between two steps; tag later tokens
        with ``version``. A step launched ahead ran with the old weights: it is dropped and the
        next ``step()`` recomputes that position with the new ones (as without run-ahead)."""
        with self._turn, self._lock, torch.no_grad():
            if self._inflight is not None:
                self._drop_inflight()
            edit()
            self.blocks.invalidate()
            if self.speculator is not None:
                self.speculator.weights_changed()  # its copy of lm_head's draft-vocabulary rows
            self.policy_version = int(version)
            self._counts["weight_updates"] += 1

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        cfg = self.model.cfg
        return {
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_used": self.blocks.num_used,
            "kv_blocks_cached": len(self.blocks.cached),
            "block_size": self.blocks.block_size,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "prefix_cache_hit_tokens": self.blocks.hit_tokens,
            "prefix_cache_line_hit_tokens": self.blocks.line_hit_tokens,
            "preemptions": self.scheduler.preemptions,
            "policy_version": self.policy_version,
            "max_model_len": self.max_model_len,
            "run_ahead": self.run_ahead,
            "run_ahead_in_flight": self._inflight is not None,
            "cuda_graph_batch_sizes": sorted(self.runner.graphs),
            "prefill_graph_tokens": sorted(self.runner.prefill_graphs),
            "prefill_graphs": sum(map(len, self.runner.prefill_graphs.values())),
            "graph_capture_s": dict(self.runner.capture_s),
            "graph_memory_bytes": self.runner.graph_memory_bytes,
            "kernels": "triton" if self.runner.triton else "torch",
            "gemv_batch1": bool(self.runner.gemv),
            "moe_experts": ("grouped_mm" if self.model.grouped_mm else "loop") if cfg.sparse_layers else None,
            "pdl": self.runner.pdl,
            **(self.speculator.stats() if self.speculator is not None else {}),
            "capture_b1_ms": dict(self.runner.capture_ms),
            "gemv_plan": {k: ",".join(map(str, v)) if v else "cublas" for k, v in (self.model.gemv_plan or {}).items()},
            **self._counts,
        }

    # ------------------------------------------------------------------ internals

    def _check_stop(self, seq: Sequence) -> str | None:
        p = seq.params
        if seq.token_ids[-1] in self.eos_ids or seq.token_ids[-1] in p.stop_token_ids:
            return "stop"
        if p.stop and self.tokenizer is not None:
            window = max(len(s) for s in p.stop) + 8  # tokens: each one is at least a char, mostly
            tail = self.tokenizer.decode(seq.completion_ids[-window:], skip_special_tokens=False)
            if any(s in tail for s in p.stop):
                return "stop"
        if seq.num_generated >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if self.runner.routes is not None and seq.block_table:  # read before its blocks are freed
            seq.routes = read_routes(self.runner.routes, seq.block_table, seq.num_computed, self.blocks.block_size)
        self.scheduler.finish(seq)
        self.runner.release([seq])
        seq.finish_reason = reason
        seq.text = self._text(seq, reason)
        self._finished[seq.request_id] = seq
        while len(self._finished) > KEEP_FINISHED:
            old, _ = self._finished.popitem(last=False)
            self._seqs.pop(old, None)

    def _text(self, seq: Sequence, reason: str) -> str:
        if self.tokenizer is None:
            return ""
        ids = seq.completion_ids
        if reason == "stop" and ids and (ids[-1] in self.eos_ids or ids[-1] in seq.params.stop_token_ids):
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        cuts = [text.find(s) for s in seq.params.stop if s in text]
        return text[:min(cuts)] if cuts else text

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one KV-cache block: K and V of ``block_size`` tokens in every layer."""
        cfg = self.model.cfg
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * \
            next(self.model.parameters()).element_size()

    def _default_kv_blocks(self, blocks_per_seq: int, block_size: int, fraction: float) -> int:
        per_block = self.kv_block_bytes(block_size)
        want = self.max_num_seqs * blocks_per_seq * 2  # room for every sequence plus as much cached prefix
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(blocks_per_seq, min(want, int(free * fraction) // per_block))
        return max(blocks_per_seq, min(want, (1 << 30) // per_block))  # <= 1 GiB of CPU memory


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    if tokenizer is None:
        return frozenset()
    from opencomposer.policies.model import (
        stop_token_ids,  # the one definition of end-of-turn ids
    )

    return frozenset(stop_token_ids(model, tokenizer))


def _out_of_memory(e: BaseException | None) -> bool:
    """Is ``e``, or an exception it was raised from or during, a CUDA out-of-memory error (a
    graph capture that ran out of memory can surface as a failed capture, the OOM as its cause)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower():
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
