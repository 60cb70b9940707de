"""``MTPHead``: a multi-token-prediction head that drafts tokens for speculative decoding.

One small head, applied repeatedly. From the base model's final hidden state at position
``i`` (after the final norm: what ``lm_head`` reads) and the embedding of token ``i + 1``,
it makes a hidden state whose ``lm_head`` logits predict token ``i + 2``; fed its own
output and the token drafted from it, it goes on to ``i + 3`` and further:

    u  = W_in [norm_h(h); norm_e(embed(token))]          (2d -> d)
    u  = u + down(silu(gate(norm_m(u))) * up(norm_m(u)))
    h' = norm_out(u)                                     logits = lm_head(h')

It shares the base model's ``embed_tokens`` and ``lm_head`` (passed in, never stored), so a
head is a few million parameters (2.8M for SmolLM2-135M). There is no attention inside:
drafting needs no KV cache of its own, only the hidden state the base model's last step
computed anyway. Trained by self-distillation (``train/mtp.py``): the targets are the base
model's own next-token distributions, so the drafts are what the model itself would sample.

A head is a directory: ``mtp.safetensors`` (its weights) and ``mtp.json`` (its shapes, the
base model it was trained on, and training figures), written atomically by ``save``.

    head = MTPHead.load("runs/mtp/head", hidden_size=576, vocab_size=49152)
    h2 = head(h, embed(tokens)); logits = lm_head(h2)

Test: ``pytest tests/unit/train/test_mtp.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WEIGHTS, CONFIG = "mtp.safetensors", "mtp.json"


class MTPError(ValueError):
    """A head that cannot be read or does not fit the model it is used with."""


@dataclass
class MTPConfig:
    hidden_size: int
    vocab_size: int
    intermediate_size: int = 0  # 0: 2 x hidden_size
    rms_norm_eps: float = 1e-5
    # drafts come from the draft_vocab_size most frequent tokens of the training data only
    # (0: the whole vocabulary): the head's lm_head GEMV reads that many rows, not all of them
    draft_vocab_size: int = 0
    base_model: str = ""  # what it was trained on (name or path), for the error when misused
    trained: dict[str, Any] = field(default_factory=dict)  # steps, tokens, final loss, acceptance

    def __post_init__(self) -> None:
        if self.intermediate_size <= 0:
            self.intermediate_size = 2 * self.hidden_size


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype) * self.weight


class MTPHead(nn.Module):
    def __init__(self, cfg: MTPConfig):
        super().__init__()
        self.cfg = cfg
        d, m, eps = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps
        self.norm_h, self.norm_e, self.norm_m, self.norm_out = (_Norm(d, eps) for _ in range(4))
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * m, bias=False)
        self.down = nn.Linear(m, d, bias=False)
        nn.init.normal_(self.proj.weight, std=d ** -0.5 / 2)
        nn.init.normal_(self.gate_up.weight, std=d ** -0.5)
        nn.init.zeros_(self.down.weight)  # the block starts as the identity on u
        # the token ids drafts are drawn from (``draft_vocab_size`` of them), most frequent first
        self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size or cfg.vocab_size, dtype=torch.long))

    def set_draft_vocab(self, token_counts: torch.Tensor, size: int) -> float:
        """Keep the ``size`` most frequent tokens (``token_counts`` [vocab]) as the draft
        vocabulary; returns the share of the counted tokens they cover."""
        size = min(size, self.cfg.vocab_size)
        order = token_counts.argsort(descending=True)[:size]
        self.draft_vocab = order.to(self.draft_vocab.device)
        self.cfg.draft_vocab_size = size
        return float(token_counts[order].sum() / token_counts.sum().clamp(min=1))

    def forward(self, hidden: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """``hidden`` [..., d] (normed final hidden states, or this head's outputs),
        ``token_embeds`` [..., d] (embeddings of the next tokens) -> [..., d] for ``lm_head``."""
        u = self.proj(torch.cat([self.norm_h(hidden), self.norm_e(token_embeds)], dim=-1))
        gate, up = self.gate_up(self.norm_m(u)).chunk(2, dim=-1)
        return self.norm_out(u + self.down(F.silu(gate) * up))

    # ------------------------------------------------------------------ files

    def save(self, out_dir: str | Path) -> Path:
        """Write ``out_dir/{mtp.safetensors, mtp.json}`` atomically (a temporary directory
        renamed over the old one: a reader never sees half a head; a killed save's temporary
        directory is removed by the next save beside it)."""
        from safetensors.torch import save_file

        from opencomposer.paths import remove_stale_temps, replace_dir, temp_dir

        out = Path(out_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(out.parent)
        tmp = temp_dir(out)
        try:
            save_file({k: v.detach().contiguous().cpu() if k == "draft_vocab" else v.detach().float().contiguous().cpu()
                       for k, v in self.state_dict().items()}, str(tmp / WEIGHTS))
            (tmp / CONFIG).write_text(json.dumps(asdict(self.cfg), indent=1) + "\n")
            for f in (tmp / WEIGHTS, tmp / CONFIG):
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            replace_dir(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out

    @classmethod
    def load(cls, path: str | Path, hidden_size: int | None = None, vocab_size: int | None = None,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> MTPHead:
        """Read a head saved by ``save``; ``hidden_size`` / ``vocab_size``: the model it will
        draft for (a head of another model is refused, naming both)."""
        from safetensors.torch import load_file

        path = Path(path)
        cfg_file, w_file = path / CONFIG, path / WEIGHTS
        for f in (cfg_file, w_file):
            if not f.is_file():
                raise MTPError(f"{f}: no such file; an MTP head is a directory with {CONFIG} and {WEIGHTS} "
                               "(written by `opencomposer train-mtp`)")
        try:
            raw = json.loads(cfg_file.read_text())
            cfg = MTPConfig(**raw)
        except (json.JSONDecodeError, TypeError) as e:
            raise MTPError(f"{cfg_file}: not an MTP head config ({e})") from e
        for name, want in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
            if want is not None and getattr(cfg, name) != want:
                raise MTPError(f"{cfg_file}: {name}={getattr(cfg, name)} but the model it would draft for has "
                               f"{name}={want} (the head was trained on {cfg.base_model or 'another model'!r})")
        head = cls(cfg)
        state = load_file(str(w_file))
        missing = set(head.state_dict()) - set(state)
        unexpected = set(state) - set(head.state_dict())
        if missing or unexpected:
            raise MTPError(f"{w_file}: missing tensors {sorted(missing)}, unexpected {sorted(unexpected)}")
        if not 0 <= int(state["draft_vocab"].min()) <= int(state["draft_vocab"].max()) < cfg.vocab_size:
            raise MTPError(f"{w_file}: draft_vocab holds token ids outside [0, {cfg.vocab_size})")
        for k, t in head.state_dict().items():
            if state[k].shape != t.shape:
                raise MTPError(f"{w_file}: tensor {k} has shape {tuple(state[k].shape)}, {CONFIG} implies "
                               f"{tuple(t.shape)}")
        head.load_state_dict(state)
        return head.to(device=device, dtype=dtype).eval()  # (``to`` leaves the integer buffer's dtype alone)
