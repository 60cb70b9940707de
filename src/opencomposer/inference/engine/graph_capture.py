"""CUDA-graph capture, the part of ``ModelRunner`` that records its decode and prefill steps
once at start-up so that a step is one replay (``model_runner.py`` replays them and tells why).

    runner = ModelRunner(model, ..., cuda_graphs=True)     # on CUDA: _capture -> _capture_all
    runner.graphs, runner.prefill_graphs, runner.capture_s # what was captured, and how long it took

Decode graphs, one per batch-size bucket (1, 2, 4, 8, 16, then multiples of 16 up to
``max_num_seqs``), largest first so the smaller ones fit in its memory pool; each runs the
forward and samples (``sampler.sample_plain``: temperature and greedy flags are graph inputs;
two fused Triton kernels on the Triton path) on fixed buffers (``_make_static``). At batch 1 the
graph is captured several times -- cuBLAS projections; ``triton_gemv`` projections (norms and
activation fused in) in the configs tuned per projection; that plan with each GEMV role moved
back to cuBLAS in turn -- each timed over a few replays, and the fastest is kept (``gemv=None``;
True/False forces one, see ``batch1_plan.py``); ``capture_ms`` holds every time. Then, on the
Triton path, prefill graphs: per token bucket of ``prefill_layout.PREFILL_GRAPH_TOKENS`` (up to
the step budget) one to four (tile, key splits) variants (``graph_variants``), all reading one
flat input buffer laid out by ``PrefillLayout``. Every kernel variant is compiled in parallel
before any capture. ``cuda_graphs="eager"`` puts an ``EagerReplay`` in place of each decode
graph: its ``replay()`` runs the graph's body eagerly on the same static buffers, so the graph
and run-ahead paths run (and are tested) on CPU.

Test: ``pytest tests/unit/inference/test_run_ahead.py`` (the eager stand-ins); on CUDA
``pytest tests/gpu/test_engine_cuda.py``.
"""

from __future__ import annotations

import time

import torch

from opencomposer.inference.engine.cuda_graph import capture

from opencomposer.inference.engine.batch1_plan import capture_batch1, recapture_few_rows
from opencomposer.inference.engine.prefill_layout import (
    PrefillLayout,
    bucket_variants,
    tiles_in_bucket,
)
from opencomposer.inference.engine.sampler import sample_plain
from opencomposer.inference.models.attention import AttentionBatch, attention_backends


class GraphCapture:
    """Mixed into ``ModelRunner``: captures into its ``graphs`` and ``prefill_graphs`` from its
    model, caches and settings (``max_num_seqs``, ``prefill_buckets``, ``triton``, ``gemv``, ...),
    and its decode forward (``_decode_hidden``)."""

    # ------------------------------------------------------------------ decode graphs

    def _make_static(self) -> None:
        """The decode graphs' fixed input and output buffers, and run-ahead's host buffers."""
        m, dev = self.max_num_seqs, self.device
        w = self.max_blocks_per_seq
        self._static = {
            # rows: token ids, positions, slots (padding: the scratch block), context lengths
            "vec": torch.tensor([[0] * m, [0] * m, [self.scratch_block * self.block_size] * m, [1] * m],
                                dtype=torch.long, device=dev),
            "tables": torch.full((m, w), self.scratch_block, dtype=torch.long, device=dev),
            "logits": torch.zeros(m, self.model.cfg.vocab_size, dtype=self.dtype, device=dev),
            "hidden": torch.zeros(m, self.model.cfg.hidden_size, dtype=self.dtype, device=dev),  # for drafting
            "sample_in": torch.ones(2, m, dtype=torch.float32, device=dev),  # temperatures, greedy flags
            "sampled": torch.zeros(2, m, dtype=torch.float64, device=dev),   # token ids, logprobs
        }
        cuda = dev.type == "cuda"
        self._results = [torch.zeros(2, m, dtype=torch.float64, pin_memory=cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else [None, None]

    def _bucket_sizes(self) -> list[int]:
        m = self.max_num_seqs
        return sorted(set([b for b in (1, 2, 4, 8) if b < m] + list(range(16, m, 16)) + [m]))

    @torch.inference_mode()
    def _eager_graphs(self) -> None:
        """``cuda_graphs="eager"``: per bucket an object whose ``replay()`` runs what the
        captured graph would, eagerly, on the same static buffers (tests the graph path on CPU)."""
        self._make_static()
        self.graphs = {b: EagerReplay(self, b) for b in self._bucket_sizes()}

    def _capture_all(self) -> None:
        t = time.perf_counter()

        def lap(part: str) -> None:
            nonlocal t
            torch.cuda.synchronize()
            self.capture_s[part], t = round(time.perf_counter() - t, 3), time.perf_counter()

        self._make_static()
        self._pool = None
        if self.triton:
            from opencomposer.inference.kernels.fused import parallel_compile

            # every bucket's kernel variants compiled at once, nothing of them run (one layer)
            with parallel_compile(self.device), self.model.first_layers(1):
                for b in self._bucket_sizes():
                    self._graph_body(b)
        for b in reversed(self._bucket_sizes()):  # largest first, so smaller ones fit in its pool
            self.graphs[b] = self._capture_one(b) if b > 1 or self.gemv is False else capture_batch1(self)
        if self.gemv is not False:
            recapture_few_rows(self)  # 2-4 rows with the GEMVs where that is faster
        lap("decode_graphs")
        if self.triton:
            from opencomposer.inference.kernels.prefill import warm_up

            # every variant of the eager prefill kernel (compiled in parallel), before the graphs
            warm_up(self.k_cache[0], self.model.cfg.num_heads)
            lap("warm_up")
            self._capture_prefill()
            lap("prefill_graphs")

    def _capture_one(self, b: int) -> torch.cuda.CUDAGraph:
        for _ in range(2):  # warm up (Triton compilation, allocations, kernel selection) outside the graph
            self._graph_body(b)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with capture(g, pool=self._pool):
            self._graph_body(b)
        self._pool = g.pool()
        return g

    def _graph_body(self, b: int) -> None:
        """What a decode graph of bucket ``b`` runs: forward and sample, static buffers in and out."""
        st = self._static
        hidden = self._decode_hidden(st["vec"][:, :b], st["tables"][:b])
        st["hidden"][:b] = hidden
        st["logits"][:b] = self.model.logits(hidden)
        st["sampled"][:, :b] = self._sample_in_graph(st["logits"][:b], st["sample_in"][:, :b])

    def _sample_in_graph(self, logits: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """``sampler.sample_plain``'s contract; fused Triton kernels on the Triton path."""
        if self.triton:
            from opencomposer.inference.kernels.sample import sample_plain_fused

            return sample_plain_fused(logits, inputs, self._seed)
        return sample_plain(logits, inputs)

    # ------------------------------------------------------------------ prefill graphs

    def _capture_prefill(self) -> None:
        """Graphs of the prefill forward for the ``prefill_buckets`` (after decode's)."""
        from opencomposer.inference.kernels.fused import parallel_compile

        dev, s_max, w = self.device, self.prefill_seqs, self.max_blocks_per_seq
        lay = self._prefill_layout = PrefillLayout(w, self.group, self.scratch_block, self.block_size,
                                                   self.prefill_buckets, s_max)
        buckets = self.prefill_buckets
        variants = self.graph_variants()
        flat = torch.tensor(lay.background, device=dev)  # the graphs' input buffer, starting as a no-work step
        self._pstatic = {"flat": flat, "views": lay.views(flat),
                         "logits": torch.zeros(s_max, self.model.cfg.vocab_size, dtype=self.dtype, device=dev),
                         # every row's hidden state, for speculative decoding's verify steps
                         "hidden": torch.zeros(buckets[-1], self.model.cfg.hidden_size, dtype=self.dtype, device=dev),
                         "sample_in": torch.ones(2, s_max, dtype=torch.float32, device=dev),
                         "sampled": torch.zeros(2, s_max, dtype=torch.float64, device=dev)}
        # every graph's kernel variants compiled at once, nothing of them run (one layer: the
        # others launch the same variants)
        with parallel_compile(dev), self.model.first_layers(1):
            for t in buckets:
                for v in variants[t]:
                    self._prefill_graph_forward(t, v)
        for t in sorted(buckets, reverse=True):
            st = self._pstatic
            for variant in variants[t]:
                for _ in range(2):
                    self._prefill_graph_forward(t, variant)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with capture(g, pool=self._pool):
                    hidden = self._prefill_graph_forward(t, variant)
                    st["hidden"][:t] = hidden
                    st["logits"][:] = self.model.logits(hidden[st["views"]["last"]])
                    st["sampled"][:] = self._sample_in_graph(st["logits"], st["sample_in"])
                self._pool = g.pool()
                self.prefill_graphs.setdefault(t, {})[variant] = g

    def graph_variants(self, elem_bytes: int | None = None) -> dict:
        """Bucket -> the (tile, splits) its prefill graphs are captured with (``prefill_layout.bucket_variants``
        for this engine; ``elem_bytes``: another KV element size than the engine's, e.g. 2 to
        plan a bf16 engine's graphs on a CPU one)."""
        cfg = self.model.cfg
        return bucket_variants(self.prefill_buckets, self.group, cfg.num_kv_heads, cfg.head_dim,
                               elem_bytes or self.dtype.itemsize, self.max_blocks_per_seq * self.block_size, self.sms)

    def _graph_variant(self, t: int, spans: list[tuple], variants: tuple | None = None,
                       elem_bytes: int | None = None) -> tuple:
        """The (tile, splits) graph of bucket ``t`` a step of ``spans`` replays (``triton_prefill.pick_variant``)
        among ``variants`` (by default the captured graphs')."""
        from opencomposer.inference.kernels.prefill import pick_variant

        cfg, graphs = self.model.cfg, variants or tuple(self.prefill_graphs[t])
        if len(graphs) == 1:
            return graphs[0]
        return pick_variant(graphs, t, [n for _, n, _, _ in spans], self.group, cfg.num_kv_heads, cfg.head_dim,
                            elem_bytes or self.dtype.itemsize, max(c + n for _, n, c, _ in spans), self.sms)

    def _prefill_graph_forward(self, t: int, variant: tuple) -> torch.Tensor:
        tile, splits = variant
        v = self._pstatic["views"]
        tiles = v["tiles"][:, :tiles_in_bucket(t, self.group, self.prefill_seqs, tile.rows)]
        attn = AttentionBatch(slot_mapping=v["slots"][:t], decode=False, num_tokens=t, kv_written=True,
                              prefill_tables=v["tables"], prefill_seqs=v["seqs"],
                              prefill_tiles=tiles, prefill_tile=tile, prefill_splits=splits)
        return self.model(v["ids"][:t], v["pos"][:t], attn, self.k_cache, self.v_cache)


class EagerReplay:
    """Stands in for a captured decode graph (``cuda_graphs="eager"``): ``replay()`` runs the
    graph's body eagerly, on the same static buffers."""

    def __init__(self, runner: GraphCapture, b: int):
        self.runner, self.b = runner, b

    @torch.inference_mode()
    def replay(self) -> None:
        with attention_backends():
            self.runner._graph_body(self.b)
