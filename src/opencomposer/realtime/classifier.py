"""Is a follow-up message dissatisfied? Logistic regression over hashed word and character n-grams.

    clf = default_classifier()            # trained on realtime/data/followups.jsonl (shipped)
    clf.prob("still failing, same error") # -> ~0.9
    held_out_accuracy()                   # {"accuracy": .., "n_test": .., ...}

Composer's real-time RL counts "dissatisfied follow-ups" as a negative signal. A follow-up
such as "now fix the other failing test" uses the same words as "the test still fails",
so a keyword rule misfires both ways; a linear model over n-grams learns which phrases
carry the judgement. Features: lower-cased word unigrams and bigrams plus character 3-5
grams inside word boundaries (robust to typos and inflections such as "failing"/"fails"),
hashed into ``2**16`` buckets, L2-normalised. Training: full-batch gradient descent on
the L2-regularised log-loss (a few hundred examples: milliseconds, so the model is
trained when first used rather than shipped as weights). numpy only.

The labelled set (``data/followups.jsonl``, ``{"text", "dissatisfied": 0|1}``) is written
for this project: complaints, reverts, error pastes, curt rejections (1) and thanks,
next requests, questions, approvals (0), including hard negatives that mention errors
or fixes. ``held_out_accuracy`` trains on a seeded 75% split and scores the other 25%.

Test: ``pytest tests/unit/realtime/test_classifier.py``.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from functools import lru_cache
from itertools import pairwise
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data" / "followups.jsonl"
DIM = 1 << 16
_WORD = re.compile(r"[a-z0-9']+|[^\sa-z0-9]")


def features(text: str) -> dict[int, float]:
    """Hashed n-gram counts of ``text`` (sparse: bucket -> value), L2-normalised."""
    words = _WORD.findall(text.lower())
    grams = [f"w:{w}" for w in words] + [f"b:{a} {b}" for a, b in pairwise(words)]
    for w in words:
        padded = f" {w} "
        grams += [f"c:{padded[i:i + n]}" for n in (3, 4, 5) for i in range(len(padded) - n + 1)]
    grams.append("len:" + ("short" if len(words) <= 3 else "long"))
    out: dict[int, float] = {}
    for g in grams:
        h = zlib.crc32(g.encode()) % DIM
        out[h] = out.get(h, 0.0) + 1.0
    norm = sum(v * v for v in out.values()) ** 0.5 or 1.0
    return {k: v / norm for k, v in out.items()}


def _coo(rows: list[dict[int, float]], columns: dict[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sparse design matrix as (row, column, value) arrays: ~100 non-zeros per text."""
    r, c, v = [], [], []
    for i, feats in enumerate(rows):
        for k, x in feats.items():
            r.append(i)
            c.append(columns[k])
            v.append(x)
    return np.asarray(r), np.asarray(c), np.asarray(v)


class FollowupClassifier:
    """``prob(text)``: probability that a follow-up message is dissatisfied."""

    def __init__(self, weights: np.ndarray, bias: float):
        self.w, self.b = weights, float(bias)

    @classmethod
    def train(cls, texts: list[str], labels: list[int], l2: float = 1e-4, lr: float = 4.0,
              epochs: int = 600) -> FollowupClassifier:
        if not texts or len(texts) != len(labels) or set(labels) - {0, 1}:
            raise ValueError(f"need as many 0/1 labels as texts; got {len(texts)} texts, labels {sorted(set(labels))}")
        rows = [features(t) for t in texts]
        # only the buckets the training texts use get a column: a few thousand, not 2**16
        used = sorted({k for r in rows for k in r})
        ri, ci, vals = _coo(rows, {k: j for j, k in enumerate(used)})
        y, n, d = np.asarray(labels, dtype=np.float64), len(labels), len(used)
        w, b = np.zeros(d), 0.0
        for _ in range(epochs):  # sparse products by bincount: X @ w and X.T @ g
            p = 1.0 / (1.0 + np.exp(-(np.bincount(ri, vals * w[ci], minlength=n) + b)))
            g = p - y
            w -= lr * (np.bincount(ci, vals * g[ri], minlength=d) / n + l2 * w)
            b -= lr * float(g.mean())
        full = np.zeros(DIM)
        full[used] = w
        return cls(full, b)

    def prob(self, text: str) -> float:
        z = self.b + sum(self.w[k] * v for k, v in features(text).items())
        return float(1.0 / (1.0 + np.exp(-z)))

    def dissatisfied(self, text: str, threshold: float = 0.5) -> bool:
        return self.prob(text) >= threshold


def load_examples(path: Path = DATA) -> tuple[list[str], list[int]]:
    texts, labels = [], []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text, label = row["text"], int(row["dissatisfied"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: expected {{\"text\": str, \"dissatisfied\": 0|1}}: {e}") from None
        texts.append(text)
        labels.append(label)
    return texts, labels


@lru_cache(maxsize=1)
def default_classifier() -> FollowupClassifier:
    return FollowupClassifier.train(*load_examples())


def held_out_accuracy(seed: int = 0, test_fraction: float = 0.25, path: Path = DATA) -> dict:
    """Train on a seeded split of the shipped set, score the rest (stratified by label)."""
    texts, labels = load_examples(path)
    rng = random.Random(seed)
    train_idx, test_idx = [], []
    for label in (0, 1):
        idx = [i for i, y in enumerate(labels) if y == label]
        rng.shuffle(idx)
        cut = round(len(idx) * test_fraction)
        test_idx += idx[:cut]
        train_idx += idx[cut:]
    clf = FollowupClassifier.train([texts[i] for i in train_idx], [labels[i] for i in train_idx])
    pred = [clf.dissatisfied(texts[i]) for i in test_idx]
    truth = [labels[i] == 1 for i in test_idx]
    tp = sum(p and t for p, t in zip(pred, truth))
    fp = sum(p and not t for p, t in zip(pred, truth))
    fn = sum(t and not p for p, t in zip(pred, truth))
    correct = sum(p == t for p, t in zip(pred, truth))
    return {"accuracy": correct / len(test_idx), "precision": tp / max(tp + fp, 1), "recall": tp / max(tp + fn, 1),
            "n_train": len(train_idx), "n_test": len(test_idx), "seed": seed,
            "errors": [texts[i] for i, p, t in zip(test_idx, pred, truth) if p != t]}
