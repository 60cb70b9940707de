"""``SpecGraphs``: a speculative decoding step (``speculate.py``) of plain rows as two graph
replays and one read of the results.

The eager step verifies through a prefill-shaped forward, then accepts and drafts with
dozens of eager kernels a drafted token: on an H100 it cost 2.5-7x a plain decode step
(``benchmarks/RESULTS.md``, session 17), so speculation lost everywhere there. Here:

1. **Verify as decode rows.** A sequence with ``m`` drafts is ``m + 1`` rows of a decode
   graph (``ModelRunner.decode_rows``): its last sampled token and each draft, at
   consecutive positions, row ``j`` attending to the keys up to its own position. Every row
   writes its K/V before any row attends, so the drafts before a row are read from the
   cache: a causal verify through the decode path's kernels, in the decode graph of
   ``b x (k + 1)`` rows. Each sequence has ``k + 1`` rows whatever its drafts (rows past
   them are padding), so one graph serves every step of ``b`` sequences.
2. **Accept and draft in a graph** captured per batch size ``b <= spec_max_batch``, one for
   greedy-only steps and one with sampled rows: ``acceptance.accept`` and
   ``Speculator.draft`` on static buffers, the random numbers drawn inside (a graph's RNG
   advances on each replay); tokens are drawn by an exponential race (``sampler.race``:
   every token in parallel), not ``draw``'s cumulative sum (a 230 us scan a row on an H200).
3. One device -> host read of [kept, tokens, logprobs, next drafts] per sequence.

Rows that are not plain (``sampler.is_plain``: top-k / top-p, a seed, top logprobs) take the
eager step, as do batches without a decode graph of ``b x (k + 1)`` rows (the engine
captures decode graphs up to ``spec_max_batch x (num_draft + 1)`` rows when it drafts).
With ``cuda_graphs="eager"`` (CPU tests) each graph is an object whose ``replay()`` runs
the same body eagerly on the same buffers.

Test: ``pytest tests/unit/inference/test_speculate.py -k graph``; on CUDA
``tests/gpu/test_speculate_cuda.py``.
"""

from __future__ import annotations

import torch

from opencomposer.inference.engine.cuda_graph import capture

from opencomposer.inference.engine.acceptance import accept, row_index
from opencomposer.inference.engine.block_manager import kv_slots
from opencomposer.inference.engine.sampler import is_plain, race
from opencomposer.inference.engine.sequence import Sequence


class SpecGraphs:
    def __init__(self, spec, runner):
        self.spec, self.runner = spec, runner
        k, m, dev = spec.k, spec.max_batch, runner.device
        vocab = spec.model.cfg.vocab_size
        self.static = {
            "packed": torch.zeros(m, k + 3, dtype=torch.float64, device=dev),  # drafts, count, temperature, greedy
            "q": torch.zeros(m, k, vocab, device=dev),  # the drafts' distributions (sampled rows)
            "out": torch.zeros(m, 1 + 2 * (k + 1) + k, dtype=torch.float64, device=dev),
            "q_out": torch.zeros(m, k, vocab, device=dev),  # the next drafts' distributions
        }
        # the packed inputs' host buffer (pinned on CUDA: its copy does not wait; written again
        # only after the step's results were read)
        self._packed_host = torch.zeros(m, k + 3, dtype=torch.float64, pin_memory=dev.type == "cuda")
        self._handed: list[torch.Tensor] = []  # the next drafts' distributions last given out, a view a sequence
        real = all(isinstance(g, torch.cuda.CUDAGraph) for g in runner.graphs.values())
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph | _EagerBody] = {}
        for b in range(1, m + 1):
            if runner.decode_bucket(b * (k + 1)) is None:
                continue
            for sampled in (False, True):
                self.graphs[b, sampled] = self._capture(b, sampled) if real else _EagerBody(self, b, sampled)

    def holds(self, seqs: list[Sequence]) -> bool:
        """Can this batch's step run here? Plain rows, and graphs for its size."""
        return (len(seqs), False) in self.graphs and all(is_plain(s) for s in seqs)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], drafts: list[list[int]]) -> tuple[list[list[float]], list | None]:
        """The step for ``seqs`` with their ``drafts`` (``Speculator._room``'s): host rows
        [kept, tokens (k + 1), logprobs (k + 1), next drafts (k)] and the next drafts'
        distributions, [k, V] a sequence (None if every row is greedy)."""
        spec, runner, st = self.spec, self.runner, self.static
        b, k, bs = len(seqs), spec.k, runner.block_size
        sampled = any(s.params.temperature != 0 for s in seqs)
        rows = []
        for s, d in zip(seqs, drafts):
            start = len(s) - 1  # the last sampled token's position: its K/V is computed now
            for j, tok in enumerate([s.token_ids[-1], *d]):
                rows.append((tok, start + j, kv_slots(s.block_table, start + j, bs), start + j + 1, s.block_table))
            rows += [None] * (k - len(d))
        runner.decode_rows(rows, runner.decode_bucket(b * (k + 1)))
        host = self._packed_host[:b]
        host.numpy()[:] = [d + [0] * (k - len(d)) + [len(d), s.params.temperature or 1.0, float(s.params.temperature == 0)]
                           for s, d in zip(seqs, drafts)]
        st["packed"][:b].copy_(host, non_blocking=True)
        # a sampled row's drafts' distributions: still in the graph's buffer if this batch is the
        # one the last step drafted for (the graph copies them there), else copied in (a greedy
        # row's are not read)
        if sampled and not (len(self._handed) == b and all(
                s.draft_q is h or s.params.temperature == 0 for s, h in zip(seqs, self._handed))):
            for i, (s, d) in enumerate(zip(seqs, drafts)):
                if s.draft_q is not None and d:
                    st["q"][i, :len(d)].copy_(s.draft_q[:len(d)])
        self.graphs[b, sampled].replay()
        out = st["out"][:b].tolist()  # the step's one device -> host read
        if not sampled:
            self._handed = []
            return out, None
        q = st["q_out"][:b].clone()  # the sequences' own copy: a later step of other sequences overwrites q_out
        self._handed = [q[i] for i in range(b)]
        return out, self._handed

    def _body(self, b: int, sampled: bool) -> None:
        """What the graph of ``b`` sequences runs, static buffers in and out."""
        spec, st, k = self.spec, self.static, self.spec.k
        hidden, logits = self.runner.decode_outputs()
        dev = hidden.device
        packed = st["packed"][:b]
        d, lens = packed[:, :k].long(), packed[:, k].long()
        temps, greedy = packed[:, k + 1].float(), packed[:, k + 2] > 0
        starts = torch.arange(b, device=dev) * (k + 1)
        view = logits[row_index(starts, lens, k)].float()  # [b, k + 1, V]
        u = torch.rand(b, 3 * k + 1, dtype=torch.float64, device=dev) if sampled else None
        q = None
        if sampled:  # zero past each sequence's drafts (there the bonus row samples from p alone)
            q = st["q"][:b] * (torch.arange(k, device=dev)[None, :] < lens[:, None])[..., None]
        n_keep, tokens, chosen, _ = accept(view, d, lens, temps, greedy, None, q, u[:, :2 * k + 1] if sampled else None,
                                           pick=race)
        # the next drafts start from the row that gave each sequence's last token, and that token
        nxt, q_next = spec.draft(hidden[starts + n_keep], tokens.gather(1, n_keep[:, None])[:, 0], temps, greedy,
                                 None, u[:, 2 * k + 1:] if sampled else None, pick=race)
        st["out"][:b] = torch.cat([n_keep[:, None].double(), tokens.double(), chosen.double(), nxt.double()], 1)
        if sampled:
            st["q_out"][:b] = q_next
            st["q"][:b] = q_next  # the next step's input, if it is these sequences again

    def _capture(self, b: int, sampled: bool) -> torch.cuda.CUDAGraph:
        with torch.inference_mode():
            for _ in range(2):  # warm up outside the graph (allocations, kernel selection)
                self._body(b, sampled)
            torch.cuda.synchronize(self.runner.device)
            g = torch.cuda.CUDAGraph()
            with capture(g):
                self._body(b, sampled)
        return g


class _EagerBody:
    """Stands in for a captured graph (``cuda_graphs="eager"``): ``replay()`` runs its body."""

    def __init__(self, graphs: SpecGraphs, b: int, sampled: bool):
        self.graphs, self.b, self.sampled = graphs, b, sampled

    def replay(self) -> None:
        with torch.inference_mode():
            self.graphs._body(self.b, self.sampled)
