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
same ``k`` and head, but draws other numbers than without speculation.

Test: ``pytest tests/unit/inference/test_speculate.py``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from opencomposer.inference.block_manager import BlockManager
from opencomposer.inference.sampler import draw, truncate, uniforms
from opencomposer.inference.scheduler import ScheduledBatch
from opencomposer.inference.sequence import Sequence
from opencomposer.models.mtp import MTPHead

MAX_DRAFT = 16

Result = tuple[list[int], list[float], list]  # a sequence's new tokens, their logprobs, top logprobs (or Nones)


class Speculator:
    def __init__(self, model, head: MTPHead | str | Path, k: int = 3):
        if not isinstance(k, int) or not 1 <= k <= MAX_DRAFT:
            raise ValueError(f"num_draft={k!r}: expected an int in [1, {MAX_DRAFT}] (tokens drafted per step)")
        p = next(model.parameters())
        cfg = model.cfg
        if not isinstance(head, MTPHead):
            head = MTPHead.load(head, cfg.hidden_size, cfg.vocab_size, device=p.device, dtype=p.dtype)
        elif (head.cfg.hidden_size, head.cfg.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
            raise ValueError(f"MTP head of hidden_size={head.cfg.hidden_size}, vocab_size={head.cfg.vocab_size} "
                             f"cannot draft for a model of hidden_size={cfg.hidden_size}, vocab_size={cfg.vocab_size}")
        self.model, self.head, self.k = model, head.to(device=p.device, dtype=p.dtype).eval(), k
        self._cached: tuple | None = None  # (lm_head's identity and version, its draft-vocabulary rows)
        self.counts = {"spec_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}

    def stats(self) -> dict:
        c = self.counts
        return {**c, "spec_num_draft": self.k,
                "spec_acceptance": round(c["spec_accepted_tokens"] / c["spec_draft_tokens"], 4)
                if c["spec_draft_tokens"] else None}

    @torch.inference_mode()
    def run(self, runner, blocks: BlockManager, batch: ScheduledBatch, max_model_len: int) -> list[Result]:
        """Verify ``batch``'s decode rows with their drafts; returns each sequence's new tokens
        (kept drafts, then one sampled token); the first ``len(tokens)`` of the step's positions
        (its last sampled token's and the kept drafts') have K/V in the cache. Drafts the next ones."""
        seqs = batch.seqs
        drafts = [self._room(s, blocks, max_model_len) for s in seqs]
        lens = [len(s) for s in seqs]
        for s, d in zip(seqs, drafts):
            s.token_ids.extend(d)  # what the verify step reads as its tokens; taken back below
        try:
            hidden = runner.hidden_states(ScheduledBatch(False, list(seqs), [1 + len(d) for d in drafts]))
        finally:
            for s, n in zip(seqs, lens):
                del s.token_ids[n:]
        logits = self.model.logits(hidden).float()
        results, rows, start = [], [], 0
        for s, d in zip(seqs, drafts):
            res = _accept(logits[start:start + 1 + len(d)], d, s)
            results.append(res)
            rows.append(start + len(res[0]) - 1)  # the row whose logits gave its last token
            start += 1 + len(d)
            self.counts["spec_draft_tokens"] += len(d)
            self.counts["spec_accepted_tokens"] += len(res[0]) - 1
        self.counts["spec_steps"] += 1
        self._draft(seqs, hidden[torch.tensor(rows, device=hidden.device)], [r[0] for r in results])
        return results

    def _room(self, s: Sequence, blocks: BlockManager, max_model_len: int) -> list[int]:
        """The drafts ``s`` can verify now: within max_tokens / max_model_len after the token
        sampled at the end, and within blocks it holds or can take free."""
        k = min(len(s.draft), s.params.max_tokens - s.num_generated - 1, max_model_len - len(s) - 1)
        bs = blocks.block_size
        while k > 0 and len(s) + k > len(s.block_table) * bs and blocks.num_free > 0:
            blocks.append_slot(s, len(s.block_table) * bs + 1)
        return s.draft[:max(0, min(k, len(s.block_table) * bs - len(s)))]

    def _draft(self, seqs: list[Sequence], hidden: torch.Tensor, new: list[list[int]]) -> None:
        """Chain the head ``k`` times from each sequence's ``hidden`` row and the last of its
        ``new`` tokens (this step's, not yet appended to the sequence). Drafts come from the
        head's draft vocabulary (``MTPHead.draft_vocab``); ``q`` is kept over the whole one."""
        dev = hidden.device
        temps = torch.tensor([s.params.temperature or 1.0 for s in seqs], device=dev)[:, None]
        greedy = torch.tensor([s.params.temperature == 0 for s in seqs], device=dev)
        params = [s.params for s in seqs]
        embed, vocab, rows = self.model.model.embed_tokens, self.head.draft_vocab, self._rows()
        h, tok = hidden, torch.tensor([n[-1] for n in new], device=dev)
        toks, qs = [], []
        for _ in range(self.k):
            h = self.head(h, embed(tok))
            logits = torch.nn.functional.linear(h, rows).float()  # [B, draft vocabulary]
            q = truncate((logits / temps).log_softmax(-1), params).exp()
            pick = torch.where(greedy, logits.argmax(-1), draw(q, uniforms(seqs, 1, dev)[:, 0]))
            tok = vocab[pick]
            toks.append(tok)
            qs.append(q)
        table = torch.stack(toks, 1).tolist()
        sampled = [i for i, s in enumerate(seqs) if s.params.temperature != 0]
        if sampled:  # q over the whole vocabulary, zero outside the draft vocabulary
            q_sub = torch.stack(qs, 1)[sampled]  # [S, k, N]
            q_all = q_sub.new_zeros(*q_sub.shape[:2], self.model.cfg.vocab_size)
            q_all[..., vocab] = q_sub
        where = {i: j for j, i in enumerate(sampled)}
        for i, s in enumerate(seqs):
            s.draft = [int(t) for t in table[i]]
            s.draft_q = q_all[where[i]] if i in where else None

    def _rows(self) -> torch.Tensor:
        """``lm_head``'s rows of the draft vocabulary, gathered again after the weights change."""
        w = self.model.lm_head.weight
        key = (w.data_ptr(), w._version)
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, w.index_select(0, self.head.draft_vocab))
        return self._cached[1]


def _accept(logits: torch.Tensor, draft: list[int], s: Sequence) -> Result:
    """``logits`` [k + 1, V]: the model's at the last sampled token and each draft."""
    k, p_ = len(draft), s.params
    dev = logits.device
    logprobs = (logits / (p_.temperature or 1.0)).log_softmax(-1)
    d = torch.tensor(draft, dtype=torch.long, device=dev)
    ar = torch.arange(k + 1, device=dev)
    if p_.temperature == 0:
        picks = logits.argmax(-1)  # the model's token at every row
        keep = picks[:k] == d
    else:
        p = truncate(logprobs, [p_] * (k + 1)).exp()
        u = uniforms([s], 2 * k + 1, dev)[0]
        q = s.draft_q[:k] if k else p[:0]
        keep = u[:k] * q[ar[:k], d] < p[ar[:k], d]  # accept with probability min(1, p / q)
        residual = torch.cat([(p[:k] - q).clamp_(min=0), p[k:]])  # a rejection's distribution; the bonus row's p
        empty = residual.sum(-1, keepdim=True) <= 0  # p == q there: no rejection can happen
        picks = draw(torch.where(empty, p, residual), u[k:])
    n_keep = int(keep.long().cumprod(0).sum()) if k else 0
    tokens = torch.cat([d[:n_keep], picks[n_keep:n_keep + 1]])
    rows = [tokens, logprobs[ar[:n_keep + 1], tokens]]
    top_n = min(p_.top_logprobs, logprobs.shape[-1])
    if top_n:
        values, ids = logprobs[:n_keep + 1].topk(top_n, dim=-1)
        rows += [ids.T.double(), values.T.double()]
    out = torch.cat([r.double().reshape(-1, n_keep + 1) for r in rows]).tolist()
    toks, lps = [int(t) for t in out[0]], out[1]
    tops = [[(int(out[2 + j][i]), out[2 + top_n + j][i]) for j in range(top_n)] for i in range(n_keep + 1)] \
        if top_n else [None] * (n_keep + 1)
    return toks, lps, tops
