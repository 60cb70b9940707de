"""``ModelRunner``: owns the model and the KV cache tensors; turns a scheduled batch into
one forward pass and returns the logits of the rows that sample.

On CUDA, decode steps replay CUDA graphs captured once per batch-size bucket
(1, 2, 4, 8, 16, then multiples of 16 up to ``max_num_seqs``): a decode step of a small
model is dozens of tiny kernels, and launching them one by one from Python costs more
than running them. The graphs read fixed input buffers (token ids, positions, slots,
block tables padded to ``max_model_len``, context lengths); padding rows write to a
scratch block that no sequence owns. Prefill runs eagerly. With ``triton`` (the
CUDA default) decode attention is one Triton kernel per layer instead of a gather of the
padded block table plus SDPA, and rotary + cache write, residual + RMSNorm and SiLU * up
are fused kernels too (``triton_kernels.py``), in prefill and decode.
"""

from __future__ import annotations

import torch

from opencomposer.inference.attention import (
    AttentionBatch,
    PrefillSeq,
    attention_backends,
)
from opencomposer.inference.models.transformer import DecoderLM
from opencomposer.inference.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_model_len: int, cuda_graphs: bool = True, triton: bool = False):
        self.model = model
        cfg = model.cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        model.inv_freq = model.inv_freq.to(self.device)
        self.triton = triton and self.device.type == "cuda"
        model.use_triton(self.triton)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # one extra block at the end: the scratch block that graph padding rows write to
        self.scratch_block = num_blocks
        shape = (cfg.num_layers, num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if cuda_graphs and self.device.type == "cuda":
            self._capture()

    @property
    def kv_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Forward ``batch``; returns logits [n_sampling_rows, V] in the model dtype."""
        with attention_backends():
            if batch.decode:
                return self._decode(batch)
            return self._prefill(batch)

    # ------------------------------------------------------------------ prefill

    def _prefill(self, batch: ScheduledBatch) -> torch.Tensor:
        ids, pos, slots, cached, last, fresh = [], [], [], [], [], []
        bs = self.block_size
        dev = self.device
        start = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.chunks)):
            c = seq.num_computed
            ids += seq.token_ids[c:c + n]
            pos += range(c, c + n)
            table = seq.block_table
            slots += [table[t // bs] * bs + t % bs for t in range(c, c + n)]
            if c == 0:
                fresh.append((start, n))
            else:
                bt = _to(table[:-(-(c + n) // bs)], dev)
                cached.append(PrefillSeq(q_start=start, q_len=n, ctx_len=c + n, block_table=bt))
            start += n
            if batch.samples(i):
                last.append(start - 1)
        attn = AttentionBatch(slot_mapping=_to(slots, dev), decode=False, prefill=cached, num_tokens=start,
                              kv_written=self.triton)
        if fresh:
            width = max(n for _, n in fresh)
            index = [[s + j if j < n else 0 for j in range(width)] for s, n in fresh]
            valid = [[j < n for j in range(width)] for _, n in fresh]
            attn.fresh_index = _to(index, dev)
            attn.fresh_valid = torch.tensor(valid).to(dev, non_blocking=True)
            attn.fresh_rows = _to([s + j for s, n in fresh for j in range(n)], dev)
        hidden = self.model(_to(ids, dev), _to(pos, dev), attn, self.k_cache, self.v_cache)
        return self.model.logits(hidden[_to(last, dev)])

    # ------------------------------------------------------------------ decode

    def _decode_inputs(self, batch: ScheduledBatch, width: int, rows: int):
        bs = self.block_size
        n = len(batch.seqs)
        ids = [s.token_ids[-1] for s in batch.seqs] + [0] * (rows - n)
        pos = [len(s) - 1 for s in batch.seqs] + [0] * (rows - n)
        slots = [s.block_table[(len(s) - 1) // bs] * bs + (len(s) - 1) % bs for s in batch.seqs]
        slots += [self.scratch_block * bs] * (rows - n)
        tables = [s.block_table + [self.scratch_block] * (width - len(s.block_table)) for s in batch.seqs]
        tables += [[self.scratch_block] * width] * (rows - n)
        lens = [len(s) for s in batch.seqs] + [1] * (rows - n)
        return ids, pos, slots, tables, lens

    def _decode(self, batch: ScheduledBatch) -> torch.Tensor:
        n = len(batch.seqs)
        bucket = next((b for b in sorted(self.graphs) if b >= n), None)
        if bucket is not None:
            ids, pos, slots, tables, lens = self._decode_inputs(batch, self.max_blocks_per_seq, bucket)
            st = self._static
            # two host->device copies; the graph reads these addresses
            vec = torch.tensor([ids, pos, slots, lens], dtype=torch.long)
            st["vec"][:, :bucket].copy_(vec, non_blocking=True)
            st["tables"][:bucket].copy_(torch.tensor(tables, dtype=torch.long), non_blocking=True)
            self.graphs[bucket].replay()
            return st["logits"][:n]
        width = max(len(s.block_table) for s in batch.seqs)
        ids, pos, slots, tables, lens = self._decode_inputs(batch, width, n)
        dev = self.device
        vec = _to([ids, pos, slots, lens], dev)
        return self._decode_forward(vec, _to(tables, dev))

    def _decode_forward(self, vec: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """vec [4, B] = token ids, positions, slots, context lengths; tables [B, W]."""
        attn = AttentionBatch(slot_mapping=vec[2], decode=True, block_tables=tables, context_lens=vec[3],
                              num_tokens=vec.shape[1], triton_decode=self.triton, kv_written=self.triton)
        hidden = self.model(vec[0], vec[1], attn, self.k_cache, self.v_cache)
        return self.model.logits(hidden)

    def _graph_forward(self, b: int) -> torch.Tensor:
        return self._decode_forward(self._static["vec"][:, :b], self._static["tables"][:b])

    @torch.inference_mode()
    def _capture(self) -> None:
        with attention_backends():
            self._capture_all()

    def _capture_all(self) -> None:
        m, dev = self.max_num_seqs, self.device
        w = self.max_blocks_per_seq
        self._static = {
            # rows: token ids, positions, slots (padding: the scratch block), context lengths
            "vec": torch.tensor([[0] * m, [0] * m, [self.scratch_block * self.block_size] * m, [1] * m],
                                dtype=torch.long, device=dev),
            "tables": torch.full((m, w), self.scratch_block, dtype=torch.long, device=dev),
            "logits": torch.zeros(m, self.model.cfg.vocab_size, dtype=self.dtype, device=dev),
        }
        sizes = [b for b in (1, 2, 4, 8) if b < m] + list(range(16, m, 16)) + [m]
        pool = None
        for b in sorted(set(sizes), reverse=True):  # largest first, so smaller ones fit in its pool
            for _ in range(2):  # warm up (Triton compilation, allocations, kernel selection) outside the graph
                self._graph_forward(b)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._static["logits"][:b] = self._graph_forward(b)
            pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()


def _to(values: list, device: torch.device) -> torch.Tensor:
    """int64 tensor on ``device``, built on the host first: ``torch.tensor(..., device=cuda)``
    would wait for the GPU queue to drain."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
