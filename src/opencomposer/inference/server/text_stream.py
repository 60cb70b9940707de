"""``TextStream``: one sequence's generated tokens -> the text a client may see so far.

Three things make this more than ``tokenizer.decode``:

* a byte-level BPE token can end in the middle of a UTF-8 character; text ending in the
  replacement character waits for the next token instead of being sent half-formed;
* stop strings are not returned (OpenAI semantics): the text is cut at the first one, and
  while the sequence runs, the last ``len(longest stop) - 1`` characters are held back
  because they might be the start of a stop string;
* re-decoding every token at every step would cost O(n^2): decoding restarts after each
  line ending (a character boundary), so each step decodes about one line.

    ts = TextStream(tokenizer, stops=("\\n\\n",))
    ts.add([id1, id2], [lp1, lp2]); ts.visible()   # safe to send now
    ts.final_text()                                # once finished

Test: ``pytest tests/unit/inference/test_server_chat_format.py``.
"""

from __future__ import annotations

from typing import Any

_RESTART_AFTER = 16  # tokens; decoding restarts at a line ending once this many accumulated


class TextStream:
    def __init__(self, tokenizer: Any, stops: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]] | None] = []  # per token, when the request asked
        self._text = ""  # decoded text of all tokens, as far as it is complete
        self._base, self._start = "", 0  # text of token_ids[:_start], a safe restart point

    def add(self, token_ids: list[int], logprobs: list[float],
            top_logprobs: list[list[tuple[int, float]]] | None = None) -> None:
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.top_logprobs += top_logprobs if top_logprobs is not None else [None] * len(token_ids)
        tail = self._decode(self.token_ids[self._start:])
        if tail.endswith("\ufffd"):  # an incomplete character: wait for its other bytes
            return
        self._text = self._base + tail
        if tail.endswith("\n") and len(self.token_ids) - self._start >= _RESTART_AFTER:
            self._base, self._start = self._text, len(self.token_ids)

    def visible(self) -> str:
        """Text that can be sent now without ever having to be taken back."""
        text, stopped = self._cut(self._text)
        return text if stopped or not self.hold else text[: max(0, len(text) - self.hold)]

    def final_text(self, stop_token_ids: frozenset[int] = frozenset()) -> str:
        """The whole completion (one full decode) without a final stop token, cut before
        the first stop string: what ``Engine`` returns as ``Completion.text``."""
        ids = self.token_ids[:-1] if self.token_ids and self.token_ids[-1] in stop_token_ids else self.token_ids
        return self._cut(self._decode(ids))[0]

    def token_strings(self, start: int = 0, end: int | None = None) -> list[str]:
        return [self._decode([t]) for t in self.token_ids[start:end]]

    def top_strings(self, start: int = 0) -> list[list[tuple[str, float]]]:
        """Per token from ``start``: its top alternatives as (token string, logprob); [] where none."""
        return [[(self._decode([t]), lp) for t, lp in top or []] for top in self.top_logprobs[start:]]

    def _cut(self, text: str) -> tuple[str, bool]:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return (text[: min(hits)], True) if hits else (text, False)

    def _decode(self, ids: list[int]) -> str:
        # Special tokens kept, as in ``ModelPolicy`` and ``Engine``: the text is what the model wrote.
        return self.tokenizer.decode(ids, skip_special_tokens=False)
