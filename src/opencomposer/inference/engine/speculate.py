"""``Speculator``: speculative decoding with an MTP head (``models/mtp.py``): several tokens
per decode step, distributed exactly as plain decoding's.

An engine built with ``draft=`` runs each decode step as:

1. **Draft.** Every running sequence carries up to ``k`` tokens that the head drafted at the
   end of its previous step, and the head's distributions ``q`` they were drawn from (none
   right after its prefill: that first step verifies nothing and drafts).
2. **Verify.** One forward over each sequence's last sampled token followed by its drafts --
   a prefill-shaped step on the cached prefix (``ModelRunner.hidden_states``) -- gives the
   model's logits at every position at once.
3. **Accept.** A greedy request keeps drafts while each equals the model's argmax. A sampled
   one keeps draft ``d`` with probability ``min(1, p(d) / q(d))``; at the first rejection
   it draws from ``max(0, p - q)`` renormalised, and if every draft is kept it draws a bonus
   token from the last row (rejection sampling as in Leviathan et al. 2023 and Chen et al.
   2023). ``p`` is the request's own distribution (temperature, top-k, top-p), so the
   output is distributed exactly as plain sampling from the model, whatever the head drafts;
   a better head only makes more tokens per step.
4. **Draft again** from the hidden state of the row that produced each sequence's last
   token, chaining the head ``k`` times (``MTPHead``: its output and the drafted token in).

Logprobs follow ``sampler.py``'s convention (``log_softmax(logits / T)`` before truncation) at
each kept row: the values plain decoding reports for the same tokens. K/V of rejected drafts
was written to slots past the sequence's end; those slots are overwritten as it grows, and
only whole computed blocks reach the prefix cache. Drafts take only free KV blocks (fewer
drafts when there are none), never preempting. A seeded request is reproducible with the
same ``k`` and head, but draws other numbers than without speculation. Decode batches of
more than ``max_batch`` sequences step plainly (their drafts dropped): verifying ``k + 1``
tokens a sequence multiplies a busy step's work. The default, 1, is what was measured to pay
(the embedded model on the 2-core CPU: 1.07-1.35x at batch 1, 0.42-0.67x at batch 4;
``benchmarks/RESULTS.md``).

Test: ``pytest tests/unit/inference/test_speculate.py``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from opencomposer.inference.engine.block_manager import BlockManager
from opencomposer.inference.engine.acceptance import accept, row_index
from opencomposer.inference.engine.sampler import draw, truncate, uniforms
from opencomposer.inference.engine.scheduler import ScheduledBatch
from opencomposer.inference.engine.sequence import Sequence
from opencomposer.models.mtp import MTPHead

MAX_DRAFT = 16

Result = tuple[list[int], list[float], list]  # a sequence's new tokens, their logprobs, top logprobs (or Nones)


def check_settings(k: int, max_batch: int) -> None:
    """Raise a ValueError naming ``num_draft`` / ``spec_max_batch`` if they are not usable."""
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT:
        raise ValueError(f"num_draft={k!r}: expected an int in [1, {MAX_DRAFT}] (tokens drafted per step)")
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise ValueError(f"spec_max_batch={max_batch!r}: expected an int >= 1 (larger decode batches step plainly)")


class Speculator:
    def __init__(self, model, head: MTPHead | str | Path, k: int = 3, max_batch: int = 1):
        check_settings(k, max_batch)
        self.max_batch = max_batch
        p = next(model.parameters())
        cfg = model.cfg
        if not isinstance(head, MTPHead):
            head = MTPHead.load(head, cfg.hidden_size, cfg.vocab_size, device=p.device, dtype=p.dtype)
        elif (head.cfg.hidden_size, head.cfg.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
            raise ValueError(f"MTP head of hidden_size={head.cfg.hidden_size}, vocab_size={head.cfg.vocab_size} "
                             f"cannot draft for a model of hidden_size={cfg.hidden_size}, vocab_size={cfg.vocab_size}")
        self.model, self.head, self.k = model, head.to(device=p.device, dtype=p.dtype).eval(), k
        self._cached: torch.Tensor | None = None  # lm_head's rows of the draft vocabulary
        self.counts = {"spec_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_graph_steps": 0}
        self.graphs = None  # ``spec_graph.SpecGraphs`` once attached to a runner with decode graphs

    def attach(self, runner) -> None:
        """Capture this speculator's graphs on ``runner`` (``spec_graph.py``): steps of plain
        rows then run as two graph replays. Nothing to do where the runner has no decode graphs."""
        if runner.graphs:
            from opencomposer.inference.engine.spec_graph import SpecGraphs

            self.graphs = SpecGraphs(self, runner)

    def wants(self, seqs: list[Sequence]) -> bool:
        """Speculate for this decode batch? Only up to ``max_batch`` sequences: a larger batch
        already keeps the GPU busy, and verifying k + 1 tokens a sequence would multiply its work."""
        return len(seqs) <= self.max_batch

    def forget(self, seqs: list[Sequence]) -> None:
        """These sequences take a plain step: their drafts no longer follow their last token."""
        for s in seqs:
            s.draft, s.draft_q = [], None

    def stats(self) -> dict:
        c = self.counts
        return {**c, "spec_num_draft": self.k, "spec_max_batch": self.max_batch,
                "spec_acceptance": round(c["spec_accepted_tokens"] / c["spec_draft_tokens"], 4)
                if c["spec_draft_tokens"] else None}

    @torch.inference_mode()
    def run(self, runner, blocks: BlockManager, batch: ScheduledBatch, max_model_len: int) -> list[Result]:
        """Verify ``batch``'s decode rows with their drafts; returns each sequence's new tokens
        (kept drafts, then one sampled token); the first ``len(tokens)`` of the step's positions
        (its last sampled token's and the kept drafts') have K/V in the cache. Drafts the next
        ones. Everything stays on the device until one read of the results at the end."""
        seqs = batch.seqs
        drafts = [self._room(s, blocks, max_model_len) for s in seqs]
        if self.graphs is not None and self.graphs.holds(seqs):
            host, q, width, tops = *self.graphs.run(seqs, drafts), self.k + 1, None
            self.counts["spec_graph_steps"] += 1
        else:
            host, q, width, tops = self._run_eager(runner, seqs, drafts)
        results, new = [], []
        for s, d, row in zip(seqs, drafts, host):
            n = int(row[0]) + 1
            toks = [int(t) for t in row[1:1 + n]]
            lps = row[1 + width:1 + width + n]
            top_n = s.params.top_logprobs
            if tops is not None and top_n:
                ids, vals = _unflat(row, 1 + 2 * width + self.k, width, tops)
                top = [[(int(ids[j][m]), vals[j][m]) for m in range(min(top_n, len(ids[j])))] for j in range(n)]
            else:
                top = [None] * n
            results.append((toks, lps, top))
            new.append(toks)
            self.counts["spec_draft_tokens"] += len(d)
            self.counts["spec_accepted_tokens"] += n - 1
        self.counts["spec_steps"] += 1
        self._store(seqs, [[int(t) for t in row[1 + 2 * width:1 + 2 * width + self.k]] for row in host], q, new)
        return results

    def _run_eager(self, runner, seqs: list[Sequence], drafts: list[list[int]]) -> tuple[list, torch.Tensor | None,
                                                                                         int, int | None]:
        """The step as a prefill-shaped verify (``ModelRunner.hidden_states``) and eager accept
        and draft: any rows. -> host rows [n kept, tokens, logprobs, next drafts, (top ids,
        values)], the drafts' distributions, the rows' width, top logprobs per row (or None)."""
        lens = [len(s) for s in seqs]
        for s, d in zip(seqs, drafts):
            s.token_ids.extend(d)  # what the verify step reads as its tokens; taken back below
        try:
            hidden = runner.hidden_states(ScheduledBatch(False, list(seqs), [1 + len(d) for d in drafts]))
        finally:
            for s, n in zip(seqs, lens):
                del s.token_ids[n:]
        logits = self.model.logits(hidden).float()
        dev, k = hidden.device, max(len(d) for d in drafts)
        starts = torch.tensor([0] + [1 + len(d) for d in drafts[:-1]]).cumsum(0).to(dev)
        lens = torch.tensor([len(d) for d in drafts]).to(dev)
        temps, greedy = temperatures(seqs, dev)
        params = [s.params for s in seqs]
        view = logits[row_index(starts, lens, k)]  # [B, k + 1, V]
        d = torch.tensor([x + [0] * (k - len(x)) for x in drafts], dtype=torch.long).to(dev).view(len(seqs), k)
        q = _draft_q(seqs, drafts, k, view.shape[-1], dev)
        u = uniforms(seqs, 2 * k + 1, dev) if q is not None else None
        n_keep, tokens, chosen, lse = accept(view, d, lens, temps, greedy, params, q, u)
        # the next drafts start from the row that gave each sequence's last token, and that token
        u_draft = uniforms(seqs, self.k, dev) if q is not None else None
        nxt, q_next = self.draft(hidden[starts + n_keep], tokens.gather(1, n_keep[:, None])[:, 0], temps, greedy,
                                 params, u_draft)
        parts = [n_keep[:, None].double(), tokens.double(), chosen.double(), nxt.double()]
        top_n = min(max(s.params.top_logprobs for s in seqs), view.shape[-1])
        if top_n:
            values, ids = (view / temps[:, None, None] - lse).topk(top_n, dim=-1)
            parts += [ids.flatten(1).double(), values.flatten(1).double()]
        return torch.cat(parts, 1).tolist(), q_next, k + 1, top_n or None  # the step's one device -> host read

    def _room(self, s: Sequence, blocks: BlockManager, max_model_len: int) -> list[int]:
        """The drafts ``s`` can verify now: within max_tokens / max_model_len after the token
        sampled at the end, and within blocks it holds or can take free."""
        k = min(len(s.draft), s.params.max_tokens - s.num_generated - 1, max_model_len - len(s) - 1)
        bs = blocks.block_size
        while k > 0 and len(s) + k > len(s.block_table) * bs and blocks.num_free > 0:
            blocks.append_slot(s, len(s.block_table) * bs + 1)
        return s.draft[:max(0, min(k, len(s.block_table) * bs - len(s)))]

    def draft(self, hidden: torch.Tensor, last: torch.Tensor, temps: torch.Tensor, greedy: torch.Tensor,
              params: list | None, u: torch.Tensor | None, pick=draw) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Chain the head ``k`` times from each sequence's ``hidden`` row and ``last`` token:
        [B, k] drafted ids, and [B, k, V] the distributions they were drawn from (zero outside
        the head's draft vocabulary, ``MTPHead.draft_vocab``). ``u`` [B, k]: the uniforms of
        sampled rows' draws (None: every row greedy, and no distributions are returned);
        ``pick`` draws a row's token from its weights (``sampler.draw`` / ``race``).
        ``params``: the rows' sampling settings for top-k / top-p (None: all plain). Device
        work only, so a graph can hold it (``spec_graph.py``)."""
        embed, vocab, rows = self.model.model.embed_tokens, self.head.draft_vocab, self._rows()
        h, tok = hidden, last
        toks, qs = [], []
        step = fused_head if self.model.fused else MTPHead.forward
        for j in range(self.k):
            h = step(self.head, h, embed(tok))
            logits = torch.nn.functional.linear(h, rows).float()  # [B, draft vocabulary]
            if u is None:
                chosen = logits.argmax(-1)
            else:
                lp = (logits / temps[:, None]).log_softmax(-1)
                q = (truncate(lp, params) if params else lp).exp()
                chosen = torch.where(greedy, logits.argmax(-1), pick(q, u[:, j]))
                qs.append(q)
            tok = vocab[chosen]
            toks.append(tok)
        if u is None:
            return torch.stack(toks, 1), None
        q_sub = torch.stack(qs, 1)  # [B, k, N]
        q_all = q_sub.new_zeros(*q_sub.shape[:2], self.model.cfg.vocab_size)
        q_all[..., vocab] = q_sub
        return torch.stack(toks, 1), q_all

    def _store(self, seqs: list[Sequence], drafts: list[list[int]], q: torch.Tensor | None,
               new: list[list[int]]) -> None:
        """Keep each sequence's next drafts (``new``: this step's tokens, not yet appended)."""
        for i, s in enumerate(seqs):
            s.draft = drafts[i]
            s.draft_q = None if q is None or s.params.temperature == 0 else q[i]

    def _rows(self) -> torch.Tensor:
        """``lm_head``'s rows of the draft vocabulary (gathered once; ``weights_changed`` gathers
        them again into the same buffer, which a captured graph reads)."""
        if self._cached is None:
            self._cached = self.model.lm_head.weight.index_select(0, self.head.draft_vocab)
        return self._cached

    def weights_changed(self) -> None:
        """The model's weights were edited in place (``Engine.edit_weights``): gather the rows again."""
        if self._cached is not None:
            with torch.inference_mode():  # (made inside a step: an inference tensor)
                self._cached.copy_(self.model.lm_head.weight.index_select(0, self.head.draft_vocab))


def fused_head(head: MTPHead, hidden: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
    """``MTPHead.forward`` in the engine's fused Triton kernels (CUDA): its four RMSNorms, the
    SiLU * up and the residual add each one kernel, 7 launches and 3 GEMMs a drafted token
    against ~24 (``_Norm`` alone is four ops). The norms multiply by the weight in fp32 before
    rounding, as the engine's RMSNorm does (``_Norm`` rounds first): drafts only, whose
    values change the speed, never the output's distribution."""
    from opencomposer.inference.kernels.fused import add_rmsnorm, rmsnorm, silu_mul

    d = hidden.shape[-1]
    both = hidden.new_empty(hidden.shape[0], 2 * d)
    rmsnorm(hidden, head.norm_h.weight, head.norm_h.eps, out=both[:, :d])
    rmsnorm(token_embeds, head.norm_e.weight, head.norm_e.eps, out=both[:, d:])
    u = head.proj(both)
    mlp = head.down(silu_mul(head.gate_up(rmsnorm(u, head.norm_m.weight, head.norm_m.eps))))
    return add_rmsnorm(mlp, u, head.norm_out.weight, head.norm_out.eps)  # (u += mlp in place: not read after)


def temperatures(seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's temperature (1 for greedy rows) [B] and greedy flag [B], on ``device``."""
    return (torch.tensor([s.params.temperature or 1.0 for s in seqs]).to(device),
            torch.tensor([s.params.temperature == 0 for s in seqs]).to(device))


def _draft_q(seqs: list[Sequence], drafts: list[list[int]], k: int, vocab: int, device: torch.device):
    """[B, k, V] the distributions each sequence's drafts were drawn from (zero rows where there
    is none: a greedy request's, or past its drafts); None if every request is greedy."""
    if all(s.params.temperature == 0 for s in seqs):
        return None
    q = torch.zeros(len(seqs), k, vocab, device=device)
    for i, s in enumerate(seqs):
        if s.draft_q is not None and drafts[i]:
            q[i, :len(drafts[i])] = s.draft_q[:len(drafts[i])]
    return q


def _unflat(row: list, at: int, width: int, n: int) -> tuple[list, list]:
    """Top-logprob ids and values of one sequence from its flattened host row."""
    ids = [row[at + j * n:at + (j + 1) * n] for j in range(width)]
    vals = [row[at + width * n + j * n:at + width * n + (j + 1) * n] for j in range(width)]
    return ids, vals
