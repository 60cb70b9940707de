"""``ModelRunner``: owns the model and the KV cache tensors; turns a scheduled batch into
one forward pass and returns the logits of the rows that sample.

On CUDA, decode steps replay CUDA graphs captured once per batch-size bucket
(1, 2, 4, 8, 16, then multiples of 16 up to ``max_num_seqs``): a decode step of a small
model is dozens of tiny kernels, and launching them one by one from Python costs more
than running them. The graphs read fixed input buffers (token ids, positions, slots,
block tables padded to ``max_model_len``, context lengths); padding rows write to a
scratch block that no sequence owns. With ``triton`` (the CUDA default) decode attention
is one Triton kernel per layer instead of a gather of the padded block table plus SDPA,
and rotary + cache write, residual + RMSNorm and SiLU * up are fused kernels too
(``kernels/fused.py``), in prefill and decode; on compute capability 9.0+ they are
launched with programmatic dependent launch (``pdl``, see ``kernels/fused.py``).

The graphs also sample (``sampler.sample_plain``: temperature and greedy flags are graph
inputs), so a step of plain rows (no top-k/top-p/seed/top_logprobs) is one replay and
one device->host copy of [token, logprob] pairs; other rows are sampled from the graph's
logits by ``sampler.sample``. How and when the graphs are captured (the batch-1 GEMV plan
included): ``graph_capture.py``.

Prefill steps of up to 4,096 tokens (an agent turn's new tokens on top of a cached prefix,
a group of turns, a prompt) are graphs too on the Triton path: one per token bucket in
``prefill_layout.PREFILL_GRAPH_TOKENS`` (up to the step budget), for up to ``PREFILL_GRAPH_SEQS``
sequences, padded (padding tokens write the scratch block; the paged-prefill kernel gives
padding rows no work). All host inputs travel in one copy, laid out by ``PrefillLayout``.
Longer prefill steps run eagerly.

Run-ahead decode (``launch_decode`` / ``launch_next``, the ``RunAhead`` part, ``run_ahead.py``)
queues decode steps before their inputs reach the host. ``cuda_graphs="eager"`` runs the
graphs' bodies eagerly on the same static buffers (``graph_capture.EagerReplay``: CPU tests);
the CPU default stays eager decode without static buffers.

    runner = ModelRunner(model, num_blocks, block_size, max_num_seqs, max_model_len, triton=True)
    logits, sampled = runner.run(batch)        # a ``Scheduler.schedule()`` batch

Test: ``pytest tests/unit/inference/test_prefill_host.py``; GPU: ``pytest tests/gpu/test_engine_cuda.py``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from opencomposer.inference.engine.block_manager import kv_slots
from opencomposer.inference.engine.decode_mirror import DecodeMirror, MirrorView
from opencomposer.inference.engine.graph_capture import EagerReplay, GraphCapture
from opencomposer.inference.engine.prefill_layout import (
    PREFILL_GRAPH_SEQS,
    bucket_of,
    prefill_buckets,
    prefill_inputs,
)
from opencomposer.inference.engine.run_ahead import RunAhead
from opencomposer.inference.engine.sampler import is_plain, plain_inputs
from opencomposer.inference.engine.scheduler import ScheduledBatch
from opencomposer.inference.models.attention import (
    AttentionBatch,
    PrefillSeq,
    attention_backends,
)
from opencomposer.inference.models.transformer import DecoderLM


class ModelRunner(GraphCapture, RunAhead):
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_model_len: int, cuda_graphs: bool | str = True, triton: bool = False, gemv: bool | None = None,
                 pdl: bool | None = None, max_num_batched_tokens: int | None = None):
        self.model = model
        cfg = model.cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        model.inv_freq = model.inv_freq.to(self.device)
        self.triton = triton and self.device.type == "cuda"
        model.use_triton(self.triton)
        if self.triton:
            from opencomposer.inference.kernels.fused import pdl_supported

            # programmatic dependent launch between the Triton kernels (Hopper+; see triton_kernels.py)
            self.pdl = pdl_supported(self.device) if pdl is None else bool(pdl)
        else:
            self.pdl = False
        self.block_size = block_size
        self.group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
        # multiprocessors, for the prefill kernel's key splits (an H100's where there is no GPU:
        # the host-side planning then still runs, in tests and host benchmarks)
        self.sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                    if self.device.type == "cuda" else 132)
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.prefill_buckets = prefill_buckets(max_num_batched_tokens)
        self.prefill_seqs = min(PREFILL_GRAPH_SEQS, max_num_seqs)
        # one extra block at the end: the scratch block that graph padding rows write to
        self.scratch_block = num_blocks
        shape = (cfg.num_layers, num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # a MoE model's routes, indexed like the cache (``moe.py``); None for a dense model
        self.routes = model.route_buffer((num_blocks + 1) * block_size)
        # CPU decode reads each sequence's K/V from a contiguous copy (at most the paged cache's
        # size again), not from blocks gathered every layer
        self.mirror = DecodeMirror(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, max_model_len,
                                   self.kv_bytes) if self.device.type == "cpu" else None
        self.graphs: dict[int, torch.cuda.CUDAGraph | EagerReplay] = {}
        # token bucket -> (tile, key splits) -> graph (``triton_prefill.graph_variants``: one to four a bucket)
        self.prefill_graphs: dict[int, dict[tuple, torch.cuda.CUDAGraph]] = {}
        self.gemv = gemv if self.triton else False
        self.capture_ms: dict[str, float] = {}
        # start-up cost of the graphs: wall seconds by part (decode graphs with the batch-1 plan,
        # prefill graphs, the eager kernels' warm-up), and the device memory held after capture
        # beyond what was allocated before it (the graphs' pool, static buffers, allocator cache)
        self.capture_s: dict[str, float] = {}
        self.graph_memory_bytes = 0
        self.gemv_timings: dict[str, dict[str, float]] = {}
        # graphs sample in two fused Triton kernels (one read of the logits) on the Triton path;
        # the device-side seed advances on every replay, so each replay draws new numbers
        # (drawn only there: on other paths it would shift the global RNG stream for nothing)
        self._seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.long).to(self.device) if self.triton else None
        # the Triton decode kernel's split-arrival counters, one per (sequence, KV head): zero
        # between kernels (its merging program resets them), shared by every layer and graph
        self._split_counters = torch.zeros(max_num_seqs * cfg.num_kv_heads, dtype=torch.int32,
                                           device=self.device) if self.triton else None
        if cuda_graphs not in (True, False, "eager"):
            raise ValueError(f"cuda_graphs={cuda_graphs!r}: expected True, False or 'eager'")
        eager = cuda_graphs == "eager"
        if self.gemv and (not cuda_graphs or eager):
            from opencomposer.inference.kernels.gemv import default_plan

            model.gemv_rows, model.gemv_plan = 1, default_plan(model.cfg)
        # run-ahead decode (``launch_decode`` / ``launch_next``): two host buffers its sampled
        # tokens are copied into (pinned on CUDA, so the copy is asynchronous), used in turn
        self._results: list[torch.Tensor] = []
        self._rows_host: tuple[torch.Tensor, torch.Tensor] | None = None  # ``decode_rows``' host buffers
        self._events: list = []
        self._turn = 0
        if eager:
            self._eager_graphs()
        elif cuda_graphs and self.device.type == "cuda":
            self._capture()

    @property
    def kv_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward ``batch``; returns (logits [n_sampling_rows, V] in the model dtype, and
        [2, n] sampled token ids and logprobs when a graph already sampled every row, else None)."""
        if not batch.decode and self.triton:
            # Triton attention only: no SDPA backend to pick (entering that context costs ~12 us
            # of host time on an H100 box; a prefill graph step's host work is ~0.2 ms)
            return self._prefill_triton(batch)
        with attention_backends(), _pdl(self.pdl):
            if batch.decode:
                return self._decode(batch)
            self.release(batch.seqs)  # a (re)computed prompt: a held copy may be stale
            return self._prefill(batch), None

    def release(self, seqs) -> None:
        """These sequences left decoding (finished, aborted, recomputed): their mirror slots are free."""
        if self.mirror is not None:  # (no mirror, as on a GPU: nothing to do, not even the mode switch)
            with torch.inference_mode():  # the mirror's tensors are inference tensors: moved only in this mode
                self.mirror.forget(seqs)

    # ------------------------------------------------------------------ prefill

    def _prefill_inputs(self, batch: ScheduledBatch) -> tuple:
        return prefill_inputs(batch, self.block_size)

    def _prefill(self, batch: ScheduledBatch) -> torch.Tensor:
        inputs = self._prefill_inputs(batch)
        return self.model.logits(self._torch_hidden(inputs)[_to(inputs[3], self.device)])

    @torch.inference_mode()
    def hidden_states(self, batch: ScheduledBatch) -> torch.Tensor:
        """The final hidden state of every new token of a prefill-shaped ``batch`` (cached
        prefixes allowed): speculative decoding's verification step (``speculate.py``), which
        reads logits at every row, not only the last. A prefill graph's replay where one holds
        the step (its ``hidden`` buffer: valid until the next prefill step), else eager."""
        self.release(batch.seqs)
        inputs = self._prefill_inputs(batch)
        if self.triton:
            bucket = self.prefill_bucket(len(inputs[0]), len(batch.seqs))
            if bucket in self.prefill_graphs:  # the step's graph also keeps every row's hidden state
                self._prefill_replay(bucket, batch, inputs)
                return self._pstatic["hidden"][:len(inputs[0])]
            with _pdl(self.pdl):
                return self._triton_hidden(inputs)
        with attention_backends():
            return self._torch_hidden(inputs)

    def _torch_hidden(self, inputs: tuple) -> torch.Tensor:
        ids, pos, slots, _, spans = inputs
        dev = self.device
        fresh = [(start, n) for start, n, c, _ in spans if c == 0]
        cached = [PrefillSeq(q_start=start, q_len=n, ctx_len=c + n, block_table=_to(table, dev))
                  for start, n, c, table in spans if c > 0]
        attn = AttentionBatch(slot_mapping=_to(slots, dev), decode=False, prefill=cached, num_tokens=len(ids),
                              kv_written=self.triton)
        if fresh:
            width = max(n for _, n in fresh)
            index = [[s + j if j < n else 0 for j in range(width)] for s, n in fresh]
            valid = [[j < n for j in range(width)] for _, n in fresh]
            attn.fresh_index = _to(index, dev)
            attn.fresh_valid = torch.tensor(valid).to(dev, non_blocking=True)
            attn.fresh_rows = _to([s + j for s, n in fresh for j in range(n)], dev)
        return self.model(_to(ids, dev), _to(pos, dev), attn, self.k_cache, self.v_cache)

    def _prefill_triton(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One paged-prefill kernel per layer for every sequence of the step (cached prefix or
        not); a step that a graph holds (at most the largest of ``prefill_buckets`` tokens and
        ``prefill_seqs`` sequences) replays the graph of the next token bucket instead."""
        inputs = self._prefill_inputs(batch)
        bucket = self.prefill_bucket(len(inputs[0]), len(batch.seqs))
        if bucket in self.prefill_graphs:
            return self._prefill_replay(bucket, batch, inputs)
        with _pdl(self.pdl):  # (a graph replay launches no kernel from here: its launches were captured)
            return self.model.logits(self._triton_hidden(inputs)[_to(inputs[3], self.device)]), None

    def _triton_hidden(self, inputs: tuple) -> torch.Tensor:
        """The eager Triton prefill forward of ``_prefill_inputs``' ``inputs``: every row's hidden state."""
        ids, pos, slots, _, spans = inputs
        tables = [sp[3] for sp in spans]
        padded = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
        for row, table in zip(padded, tables):
            row[:len(table)] = table
        tile = self._tile(len(ids), max(c + n for _, n, c, _ in spans))
        tiles, seqs = self._tiles(spans, tile.rows)
        dev = self.device
        attn = AttentionBatch(slot_mapping=_to(slots, dev), decode=False, num_tokens=len(ids), kv_written=True,
                              prefill_tables=_to(padded, dev),
                              prefill_seqs=_to(seqs, dev), prefill_tiles=_to(tiles, dev), prefill_tile=tile,
                              prefill_splits=self._splits(len(tiles[0]), max(seqs[2])))
        return self.model(_to(ids, dev), _to(pos, dev), attn, self.k_cache, self.v_cache)

    def prefill_bucket(self, tokens: int, seqs: int = 1) -> int | None:
        """The token bucket of the graph a prefill step of ``tokens`` tokens and ``seqs``
        sequences fits (None: none does); graphs exist where they were captured (CUDA, Triton)."""
        return bucket_of(tokens, seqs, self.prefill_buckets, self.prefill_seqs)

    def _tile(self, tokens: int, keys: int):
        """The paged-prefill kernel's tile for an eager step of ``tokens`` tokens on contexts of
        up to ``keys`` keys (``triton_prefill.tile_for``)."""
        from opencomposer.inference.kernels.prefill import tile_for

        return tile_for(tokens, self.group, self.model.cfg.head_dim, self.dtype.itemsize, keys)

    def _splits(self, tiles: int, keys: int) -> int:
        """Key splits for an eager prefill step of ``tiles`` tiles over contexts of up to ``keys`` keys."""
        from opencomposer.inference.kernels.prefill import splits_for

        cfg = self.model.cfg
        return splits_for(tiles * cfg.num_kv_heads, keys, cfg.head_dim, self.sms)

    def _tiles(self, spans: list[tuple], rows: int) -> tuple[list[list[int]], list[list[int]]]:
        """``triton_prefill.plan`` for the sequences of ``_prefill_inputs``' spans."""
        from opencomposer.inference.kernels.prefill import plan

        return plan([s for s, _, _, _ in spans], [n for _, n, _, _ in spans], [c + n for _, n, c, _ in spans], rows,
                    self.group)

    def _prefill_replay(self, t: int, batch: ScheduledBatch, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids, pos, slots, last, spans = inputs
        variant = self._graph_variant(t, spans)
        tiles, seqs = self._tiles(spans, variant[0].rows)
        lay, st = self._prefill_layout, self._pstatic
        lay.fill(ids, pos, slots, last, [sp[3] for sp in spans], seqs, tiles)
        st["flat"].copy_(lay.host_tensor, non_blocking=True)  # the graph's inputs, one copy
        sampling = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        plain = all(is_plain(s) for s in sampling)
        if plain and sampling:
            _set_sample_in(st, sampling)
        self.prefill_graphs[t][variant].replay()
        k = len(sampling)
        return st["logits"][:k], (st["sampled"][:, :k] if plain else None)

    # ------------------------------------------------------------------ decode

    def _decode_inputs(self, batch: ScheduledBatch, width: int, rows: int):
        bs = self.block_size
        n = len(batch.seqs)
        ids = [s.token_ids[-1] for s in batch.seqs] + [0] * (rows - n)
        pos = [len(s) - 1 for s in batch.seqs] + [0] * (rows - n)
        slots = [kv_slots(s.block_table, len(s) - 1, bs) for s in batch.seqs]
        slots += [self.scratch_block * bs] * (rows - n)
        tables = [s.block_table + [self.scratch_block] * (width - len(s.block_table)) for s in batch.seqs]
        tables += [[self.scratch_block] * width] * (rows - n)
        lens = [len(s) for s in batch.seqs] + [1] * (rows - n)
        return ids, pos, slots, tables, lens

    def _bucket(self, n: int) -> int | None:
        """The smallest decode graph that holds ``n`` rows (None: no graph does)."""
        return next((b for b in sorted(self.graphs) if b >= n), None)

    def _decode(self, batch: ScheduledBatch) -> torch.Tensor:
        n = len(batch.seqs)
        bucket = self._bucket(n)
        if bucket is not None:
            st = self._static
            self._copy_rows(*self._rows_of(batch.seqs, bucket), bucket)  # the graph reads these buffers
            plain = all(is_plain(s) for s in batch.seqs)
            if plain:
                _set_sample_in(st, batch.seqs)
            self.graphs[bucket].replay()
            return st["logits"][:n], (st["sampled"][:, :n] if plain else None)
        width = max(len(s.block_table) for s in batch.seqs)
        ids, pos, slots, tables, lens = self._decode_inputs(batch, width, n)
        dev = self.device
        vec = _to([ids, pos, slots, lens], dev)
        mirror = self.mirror.step(batch.seqs, self.k_cache, self.v_cache) if self.mirror is not None else None
        return self._decode_forward(vec, _to(tables, dev), mirror), None

    def _replay_decode(self, bucket: int) -> None:
        """Replay the decode graph of ``bucket`` (inputs already in its buffers)."""
        with attention_backends(), _pdl(self.pdl):
            self.graphs[bucket].replay()

    def _decode_forward(self, vec: torch.Tensor, tables: torch.Tensor, mirror: MirrorView | None = None) -> torch.Tensor:
        """vec [4, B] = token ids, positions, slots, context lengths; tables [B, W] -> logits."""
        return self.model.logits(self._decode_hidden(vec, tables, mirror))

    def _decode_hidden(self, vec: torch.Tensor, tables: torch.Tensor, mirror: MirrorView | None = None) -> torch.Tensor:
        attn = AttentionBatch(slot_mapping=vec[2], decode=True, block_tables=tables, context_lens=vec[3],
                              num_tokens=vec.shape[1], triton_decode=self.triton, kv_written=self.triton,
                              decode_counters=self._split_counters, mirror=mirror)
        return self.model(vec[0], vec[1], attn, self.k_cache, self.v_cache)

    @torch.inference_mode()
    def decode_rows(self, rows: list[tuple[int, int, int, int, list[int]] | None], bucket: int) -> None:
        """Replay the decode graph of ``bucket`` on ``rows`` given directly, each (token id,
        position, slot, context length, block table), or None for a padding row; the rest of
        the bucket is padding too. Rows of one sequence at consecutive positions are its next
        tokens verified in one step (speculative decoding, ``spec_graph.py``): every row
        writes its K/V before any row attends, and a row sees the keys up to its own context
        length. The results are in ``decode_outputs()`` until the next decode step."""
        vec_t, tables_t = self._host_rows(bucket)
        vec, tables = vec_t.numpy(), tables_t.numpy()
        for i, row in enumerate(rows):
            if row is not None:
                tok, pos, slot, ctx, table = row
                vec[:, i] = (tok, pos, slot, ctx)
                tables[i, :len(table)] = table
        self._copy_rows(vec_t, tables_t, bucket)
        self._replay_decode(bucket)

    def _host_rows(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode graphs' host input buffers, reset to padding rows: vec [4, max_num_seqs]
        (token ids, positions, slots, context lengths; all of it, one contiguous copy) and block
        tables [bucket, max_blocks_per_seq]. Pinned on CUDA, so their copies do not wait for the
        host. They are written again by the next decode step: each step's results are read,
        which waits for these copies, before the next one is built."""
        if self._rows_host is None:
            cuda = self.device.type == "cuda"
            self._rows_host = (torch.empty(4, self.max_num_seqs, dtype=torch.long, pin_memory=cuda),
                               torch.empty(self.max_num_seqs, self.max_blocks_per_seq, dtype=torch.long, pin_memory=cuda))
        vec_t, tables_t = self._rows_host[0], self._rows_host[1][:bucket]
        pad = self.scratch_block
        vec_t.numpy()[:] = np.array([[0], [0], [pad * self.block_size], [1]])
        tables_t.numpy().fill(pad)
        return vec_t, tables_t

    def _rows_of(self, seqs: list, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``_host_rows`` holding a decode step of ``seqs`` (each computes its last token).
        Written with numpy: building the [bucket, max_blocks_per_seq] table as nested lists and
        converting it cost ~5 ms a step at 88 sequences and an agent engine's 512-block width."""
        vec_t, tables_t = self._host_rows(bucket)
        vec, tables = vec_t.numpy(), tables_t.numpy()
        n, bs = len(seqs), self.block_size
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        pos = np.fromiter((len(s) - 1 for s in seqs), dtype=np.int64, count=n)
        vec[0, :n] = [s.token_ids[-1] for s in seqs]
        vec[1, :n] = pos
        vec[2, :n] = tables[np.arange(n), pos // bs] * bs + pos % bs  # ``kv_slots`` of each row's position
        vec[3, :n] = pos + 1
        return vec_t, tables_t

    def _copy_rows(self, vec_t: torch.Tensor, tables_t: torch.Tensor, bucket: int) -> None:
        """Send ``_host_rows`` to the decode graphs' input buffers (two host->device copies)."""
        st = self._static
        st["vec"].copy_(vec_t, non_blocking=True)
        st["tables"][:bucket].copy_(tables_t, non_blocking=True)

    def decode_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode graphs' output buffers: hidden states [max_num_seqs, H], logits [max_num_seqs, V]."""
        return self._static["hidden"], self._static["logits"]

    def decode_bucket(self, n: int) -> int | None:
        """The decode graph ``decode_rows`` replays for ``n`` rows (None: no graph holds them)."""
        return self._bucket(n)

    @torch.inference_mode()
    def _capture(self) -> None:
        before = torch.cuda.memory_allocated(self.device)
        with attention_backends(), _pdl(self.pdl):
            self._capture_all()
        self.graph_memory_bytes = torch.cuda.memory_reserved(self.device) - before


def _pdl(on: bool):
    """Programmatic dependent launch for the Triton kernels launched inside, iff ``on``."""
    if not on:
        return contextlib.nullcontext()
    from opencomposer.inference.kernels.fused import pdl_launches

    return pdl_launches()


def _set_sample_in(static: dict, seqs: list) -> None:
    """Copy plain rows' sampling inputs (``sampler.plain_inputs``) into a graph's
    ``static["sample_in"]``, unless it already holds them: most steps sample like the one
    before (the key of what it holds is kept beside it)."""
    how = plain_inputs(seqs)
    key = (len(seqs), *map(tuple, how))
    if key != static.get("sample_key"):
        static["sample_in"][:, :len(seqs)].copy_(torch.tensor(how, dtype=torch.float32), non_blocking=True)
        static["sample_key"] = key


def _to(values: list, device: torch.device) -> torch.Tensor:
    """int64 tensor on ``device``, built on the host first: ``torch.tensor(..., device=cuda)``
    would wait for the GPU queue to drain."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
