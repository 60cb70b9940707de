"""``Engine``: the rollout and serving engine (continuous batching over a paged KV cache).

    from opencomposer.inference.engine.core import Engine, SamplingParams
    engine = Engine.from_name("tiny-random")            # or Engine(hf_model, tokenizer, ...)
    [c] = engine.generate([prompt_ids], SamplingParams(max_tokens=32, temperature=0))
    c.token_ids, c.logprobs, c.policy_versions, c.text, c.finish_reason, c.cached_prompt_tokens

Streaming / serving: ``add_request`` then call ``step()`` in a loop (one thread owns the
engine; ``step`` is not thread-safe, ``update_weights`` is). Each step is schedule -> run the
model -> sample -> post-process, for all running sequences at once; finished sequences leave the
batch and waiting ones join it between any two steps. A step runs in one of three modes: plain
(prefill, or decode run to its results), launched (run-ahead decode: the same batch's next step
is launched from tokens still on the device before this one is read, ``run_ahead.py``), or
speculative. ``generate`` steps the whole engine until its own requests finish: use it when you
own the engine (tests, ``EnginePolicy``), not beside a server loop that also steps it. What the
outputs mean (logprobs, policy versions, stop tokens, text): ``outputs.py``; the options and
their defaults (``kernels``, ``cuda_graphs``, ``gemv``, ``kv_blocks``): ``build.py``.

``stats()`` reports blocks (total / used / cached; used is 0 when idle, so a leak shows),
running / waiting, prefix-cache hit tokens, preemptions, tokens and seconds spent in prefill and
decode steps, the policy version, and on CUDA which graphs exist (decode batch sizes, prefill
token buckets) and the batch-1 GEMV plan; with run-ahead, the steps launched ahead and the rows
of them dropped (``run_ahead_steps``, ``run_ahead_discarded_rows``: neither counts as generated
tokens; ``steps`` counts steps whose results were used); ``weight_update_wait_steps``: the steps
weight updates waited for (the turnstile keeps it to at most one an update). ``cuda_graphs="eager"``
runs the decode graphs' bodies eagerly on their static buffers (CPU tests of the graph and run-ahead
paths).

Speculative decoding: ``draft`` (an ``MTPHead`` or its directory, ``models/mtp.py``) with
``num_draft`` drafted tokens a step; decode batches of up to ``spec_max_batch`` sequences then
verify each sequence's drafts in one step and keep what rejection sampling accepts
(``speculate.py``): several tokens a step, each reported in one ``StepOutput`` per sequence,
outputs distributed exactly as without; ``stats()`` adds ``spec_*`` counts. No run-ahead then.

Test: ``pytest tests/unit/inference``; GPU: ``pytest tests/gpu/test_engine_cuda.py``; ``opencomposer bench engine``.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from opencomposer.inference.engine.block_manager import BlockManager
from opencomposer.inference.engine.build import (
    build_runner,
    choose_kernels,
    decode_graph_rows,
    decode_modes,
    engine_model,
    kv_block_bytes,
    kv_blocks_for,
)
from opencomposer.inference.engine.outputs import Completion, StepOutput, completion_text, stop_reason
from opencomposer.inference.engine.run_ahead import InFlight, launch_ahead, may_run_ahead
from opencomposer.inference.engine.sampler import sample
from opencomposer.inference.engine.scheduler import ScheduledBatch, Scheduler
from opencomposer.inference.engine.sequence import SamplingParams, Sequence, Status
from opencomposer.inference.models.moe import read_routes

__all__ = ["Engine", "SamplingParams"]

KEEP_FINISHED = 4096  # finished requests kept for ``completion()`` (oldest dropped first)


AGENT_CONTEXT = 8192  # tokens of an agent conversation an engine for episodes holds (Engine.for_agents)


def runqueue_ns(tid: int | None) -> int:
    """Nanoseconds thread ``tid`` of this process has spent runnable but waiting for a core (the second
    field of Linux's ``/proc/self/task/<tid>/schedstat``); 0 where the kernel does not say."""
    if tid is None:
        return 0
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0

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
        self.model, self.eos_ids = engine_model(model, tokenizer, device, dtype)
        self.tokenizer = tokenizer
        cfg = self.model.cfg
        self.device = next(self.model.parameters()).device
        self.max_model_len = max_model_len or min(cfg.max_position_embeddings, 4096)
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        self.max_num_seqs = max_num_seqs
        kv_source = "kv_blocks as given" if kv_blocks is not None else f"kv_memory_fraction={kv_memory_fraction} of free memory"
        kv_blocks = kv_blocks_for(self.model, kv_blocks, self.max_model_len, max_num_seqs, block_size,
                                  kv_memory_fraction)
        self.blocks = BlockManager(kv_blocks, block_size)
        budget = max_num_batched_tokens or max(2048, min(self.max_model_len, 8192))
        self.scheduler = Scheduler(self.blocks, max_num_seqs, budget)
        kernels, cuda_graphs, gemv = choose_kernels(self.model, kernels, cuda_graphs, gemv)
        graph_rows = decode_graph_rows(max_num_seqs, draft, num_draft, spec_max_batch)
        with self._on_device():  # graph capture and Triton launches go to the current CUDA device
            self.runner = build_runner(self.model, kv_blocks, block_size, graph_rows, self.max_model_len, budget,
                                       cuda_graphs=cuda_graphs, kernels=kernels, gemv=gemv, pdl=pdl,
                                       max_num_seqs=max_num_seqs, kv_source=kv_source)
            self.speculator, self.run_ahead = decode_modes(self.model, self.runner, draft, num_draft,
                                                           spec_max_batch, run_ahead)
        self._inflight: InFlight | None = None  # a decode step launched ahead, results not read yet
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
                        "weight_updates": 0, "weight_update_wait_steps": 0,
                        "prefill_seconds": 0.0, "decode_seconds": 0.0,
                        "run_ahead_steps": 0, "run_ahead_discarded_rows": 0,
                        # a whole step's wall time and its thread's CPU time: the difference is time spent
                        # waiting, for the device or for the interpreter (another thread holding the GIL)
                        "step_seconds": 0.0, "step_cpu_seconds": 0.0,
                        }
        self._stepper: int | None = None  # the stepping thread's native id: its run-queue time (counts)

    @classmethod
    def for_agents(cls, model: Any, tokenizer: Any, **kw: Any) -> Engine:
        """An engine for agent episodes (rollouts, evaluations): conversations up to
        ``AGENT_CONTEXT`` tokens, or the model's whole context where it is shorter."""
        kw.setdefault("max_model_len", min(int(model.config.max_position_embeddings), AGENT_CONTEXT))
        return cls(model, tokenizer, **kw)

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

    def _on_device(self) -> contextlib.AbstractContextManager:
        """The engine's CUDA device made current: an engine on ``cuda:1`` beside a trainer on ``cuda:0``
        (``[rollout] engine_devices``) captures its graphs on its own device's stream and launches its
        Triton kernels there, whatever device the calling thread has current."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def step(self) -> list[StepOutput]:
        """One step of every running sequence: schedule -> run -> post-process, in one of three
        modes (a decode step left in flight by the last step is this step's run)."""
        with self._turn:  # an in-flight weight update waiting for the lock goes first
            pass
        with self._lock, self._on_device():
            cpu0, self._stepper = time.thread_time(), threading.get_native_id()
            outputs = [StepOutput(s.request_id, [], [], True, "abort") for s in self._aborted]
            self._aborted.clear()
            t0 = time.perf_counter()
            try:
                launched, self._inflight = self._inflight, None
                if launched is not None:
                    self._launched_step(launched, t0, outputs)
                elif (batch := self.scheduler.schedule()) is None:
                    pass
                elif self._speculates(batch):
                    self._speculative_step(batch, t0, outputs)
                elif (launched := self._launch(batch)) is not None:
                    self._launched_step(launched, t0, outputs)
                else:
                    self._plain_step(batch, t0, outputs)
            finally:
                self._counts["step_seconds"] += time.perf_counter() - t0
                self._counts["step_cpu_seconds"] += time.thread_time() - cpu0
            return outputs

    def _speculates(self, batch: ScheduledBatch) -> bool:
        """Is ``batch`` a speculative step? A decode batch the speculator does not take steps
        plainly, which moves its sequences past their drafts."""
        if self.speculator is None or not batch.decode:
            return False
        if self.speculator.wants(batch.seqs):
            return True
        self.speculator.forget(batch.seqs)
        return False

    def _launch(self, batch: ScheduledBatch) -> InFlight | None:
        """Launch the decode step ``batch`` without waiting for its results (run-ahead), or
        None where it cannot be (a prefill step, no graph holds it, rows not plain)."""
        launch = self.runner.launch_decode(batch) if self.run_ahead and batch.decode else None
        return None if launch is None else InFlight(batch.seqs, launch, self.policy_version)

    def _launched_step(self, launched: InFlight, t0: float, outputs: list[StepOutput]) -> None:
        """Read and post-process a decode step launched on the device, after launching the
        next one where it may run ahead (``run_ahead.py``)."""
        if may_run_ahead(self.scheduler, self.blocks, launched.seqs, self.max_model_len):
            self._counts["run_ahead_steps"] += 1
            self._inflight = launch_ahead(self.runner, self.blocks, launched, self.policy_version)
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

    def _plain_step(self, batch: ScheduledBatch, t0: float, outputs: list[StepOutput]) -> None:
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

    def _speculative_step(self, batch: ScheduledBatch, t0: float, outputs: list[StepOutput]) -> None:
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
            reason = stop_reason(seq, self.eos_ids, self.tokenizer, self.max_model_len)
            if reason:
                self._finish(seq, reason)
                break
        outputs.append(StepOutput(seq.request_id, toks[:n], lps[:n], reason is not None, reason,
                                  tops[:n] if tops[0] is not None else None))

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
        return Completion.of(seq)

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
        with self._turn:
            steps = self._counts["steps"]
            with self._lock, torch.no_grad(), self._on_device():
                # the steps this edit waited for once it held the turnstile: one at most (the step
                # running, or one already past the turnstile)
                self._counts["weight_update_wait_steps"] += self._counts["steps"] - steps
                if self._inflight is not None:
                    self._drop_inflight()
                edit()
                self.blocks.invalidate()
                if self.speculator is not None:
                    self.speculator.weights_changed()  # its copy of lm_head's draft-vocabulary rows
                self.policy_version = int(version)
                self._counts["weight_updates"] += 1

    # ------------------------------------------------------------------ stats

    def counts(self) -> dict[str, float]:
        """The running counters alone (prompt, prefill and generated tokens, steps, seconds; ``stats``
        holds them with the rest): cheap to poll from another thread. ``step_runqueue_seconds``: the stepping
        thread's time runnable but without a core (cores taken by sandboxes, graders, other threads), read
        from Linux here rather than in the step, which would pay two file reads a step for it."""
        return {**self._counts, "step_runqueue_seconds": runqueue_ns(self._stepper) / 1e9}

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
            **self.counts(),
        }

    # ------------------------------------------------------------------ internals

    def _finish(self, seq: Sequence, reason: str) -> None:
        if self.runner.routes is not None and seq.block_table:  # read before its blocks are freed
            seq.routes = read_routes(self.runner.routes, seq.block_table, seq.num_computed, self.blocks.block_size)
        self.scheduler.finish(seq)
        self.runner.release([seq])
        seq.finish_reason = reason
        seq.text = completion_text(seq, reason, self.eos_ids, self.tokenizer)
        self._finished[seq.request_id] = seq
        while len(self._finished) > KEEP_FINISHED:
            old, _ = self._finished.popitem(last=False)
            self._seqs.pop(old, None)

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one KV-cache block: K and V of ``block_size`` tokens in every layer."""
        return kv_block_bytes(self.model, block_size)
