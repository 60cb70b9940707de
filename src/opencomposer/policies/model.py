"""``ModelPolicy``: a local Hugging Face model behind the ``Policy`` protocol.

One ``act(messages, tools)`` is one assistant turn: render the prompt with
``chat.render_prompt`` (the only prompt builder), sample with HF ``generate`` until a
stop token or the token budget, then parse ``<tool_call>`` blocks with the harness codec.

    policy = ModelPolicy("smollm2-135m", temperature=0.7, seed=0)
    out = policy.act([Message("user", "Say hello")], tools=[])
    out.text, out.tool_calls, out.token_ids, out.logprobs, out.finish_reason

Batching: ``act`` is ``sample_batch([encode(messages, tools)])``. ``sample_batch`` runs
several prompts through one left-padded ``generate`` and cuts each row at its own stop
token; ``policies.batched.BatchedPolicy`` uses it to serve many concurrent episodes.

Token-level fields, for RL:

* ``token_ids`` are the sampled completion ids, the stop token included when the turn
  ended on one (the model must learn to emit it); ``text`` is their decoding without it.
* ``logprobs[i]`` is log p(token_ids[i]) under the distribution the sampler actually drew
  from: the model's logits after the logits processors (temperature, top-k, top-p),
  renormalised, i.e. ``compute_transition_scores(..., normalize_logits=True)`` on
  ``output_scores``. Tokens outside the top-p/top-k set have -inf there, but a sampled
  token never does, so every value is finite and <= 0. With ``temperature=0`` (greedy)
  no warpers run and these are the model's plain temperature-1 log-probabilities.
  A trainer computing importance ratios must apply the same temperature to its logits.
* The model's own ``generation_config.json`` sampling defaults (Qwen ships top_k=20 and
  repetition_penalty=1.05, for instance) are overridden, so the sampler is exactly what
  this class's arguments say and the logprobs mean what is written above.

Context: the policy never edits the conversation. If the rendered prompt leaves no room
in the model's context it raises ``ContextLengthError`` (the harness owns shortening the
history, by self-summarisation); silently dropping turns here would make the prompt the
model saw differ from ``render_prompt(messages)``, which is what RL training recomputes.
When the prompt fits but ``max_new_tokens`` would overflow, the budget shrinks to the room
left and a turn that fills it ends with ``finish_reason="length"``.

Test: ``pytest tests/unit/policies/test_model_policy.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from opencomposer.models import codec
from opencomposer.models.chat import encode_prompt, ensure_chat_template, render_prompt, stop_token_ids
from opencomposer.models.registry import DEFAULT_MODEL, load_model
from opencomposer.protocols import ContextLengthError, Message, PolicyOutput

# Values that switch off every logits processor we do not ask for, so none can sneak in
# from the model's generation_config.json (``generate`` fills unset fields from there).
_NEUTRAL = dict(
    repetition_penalty=1.0,
    typical_p=1.0,
    epsilon_cutoff=0.0,
    eta_cutoff=0.0,
    no_repeat_ngram_size=0,
    min_new_tokens=0,
)


class PromptPolicy:
    """What every local sampler shares: the prompt from ``models.chat`` (the one prompt
    builder), ``act`` as a batch of one, and the per-turn token budget that stops at the
    context's end. Subclasses give ``tokenizer``, ``max_new_tokens``, ``sample_batch`` and
    ``_context()`` -> (context size, how to name it in errors)."""

    tokenizer: Any
    max_new_tokens: int

    def _context(self) -> tuple[int, str]:  # pragma: no cover - subclasses override
        raise NotImplementedError

    def sample_batch(self, prompts: list[list[int]]) -> list[PolicyOutput]:  # pragma: no cover
        raise NotImplementedError

    def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> PolicyOutput:
        return self.sample_batch([self.encode(messages, tools)])[0]

    def encode(self, messages: list[Message], tools: list[dict[str, Any]]) -> list[int]:
        """The prompt ids of one turn; raises ``ContextLengthError`` if no room is left."""
        prompt_ids = encode_prompt(self.tokenizer, render_prompt(self.tokenizer, messages, tools))
        self._budget(prompt_ids)
        return prompt_ids

    def _budget(self, prompt_ids: list[int]) -> int:
        limit, what = self._context()
        room = limit - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(
                f"prompt is {len(prompt_ids)} tokens but {what} is {limit}; "
                f"shorten the conversation (summarise or drop old turns)"
            )
        return min(self.max_new_tokens, room)


class ModelPolicy(PromptPolicy):
    """A local causal LM answering harness conversations; implements ``Policy``.

    ``model`` is a name for ``load_model`` (``"smollm2-135m"``, ``"tiny-random"``, a path,
    a hub id) or an already loaded ``(model, tokenizer)`` pair, e.g. one a trainer updates
    in place (then bump ``policy_version`` so trajectories record which weights sampled).
    ``seed`` makes sampling reproducible: call *n* uses seed ``seed + n``, drawn from a
    private RNG state, so the caller's global torch RNG is left untouched.
    """

    def __init__(
        self,
        model: str | tuple[Any, Any] = DEFAULT_MODEL,
        *,
        temperature: float = 0.7,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int = 512,
        seed: int | None = None,
        max_context: int | None = None,
        name: str | None = None,
        device: str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        policy_version: int = 0,
    ) -> None:
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or max_new_tokens < 1:
            raise ValueError(
                f"bad sampling settings: temperature={temperature} (>= 0), top_p={top_p} "
                f"(in (0, 1]), top_k={top_k} (>= 0, 0 = off), max_new_tokens={max_new_tokens} (>= 1)"
            )
        if isinstance(model, str):
            self.model, self.tokenizer = load_model(model, dtype=dtype, device=device)
            self.name = name or model
        else:
            self.model, self.tokenizer = model
            ensure_chat_template(self.tokenizer)
            # from_pretrained records the directory or hub id; its last part names the model
            origin = str(getattr(self.model.config, "_name_or_path", "") or "local-model")
            self.name = name or Path(origin).name
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.max_context = max_context or int(self.model.config.max_position_embeddings)
        self.policy_version = policy_version
        self.stop_ids = stop_token_ids(self.model, self.tokenizer)
        self._calls = 0

    def _context(self) -> tuple[int, str]:
        return self.max_context, f"{self.name}'s context"

    def sample_batch(self, prompts: list[list[int]]) -> list[PolicyOutput]:
        """One turn for each prompt (ids from ``encode``), generated as one left-padded batch.

        ``act`` is this with a batch of one; ``policies.batched.BatchedPolicy`` gathers the
        prompts of concurrent episodes. Each output is cut at its own first stop token.
        """
        version = self.policy_version  # read before generating: the weights that sample
        budgets = [self._budget(p) for p in prompts]
        outputs: list[PolicyOutput | None] = [None] * len(prompts)
        # One generate call per budget: a smaller budget means a prompt near the context
        # end, whose positions must not run past it while longer budgets finish.
        for budget in sorted(set(budgets)):
            rows = [i for i, b in enumerate(budgets) if b == budget]
            for i, (ids, logprobs) in zip(rows, self._sample([prompts[i] for i in rows], budget)):
                outputs[i] = self._output(prompts[i], ids, logprobs, version)
        return outputs  # type: ignore[return-value]  # every row was filled above

    def _output(self, prompt_ids: list[int], ids: list[int], logprobs: list[float], version: int) -> PolicyOutput:
        stopped = bool(ids) and ids[-1] in self.stop_ids
        text = self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
        _, calls = codec.parse_tool_calls(text)
        return PolicyOutput(
            text=text,
            tool_calls=calls,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(ids),
            token_ids=ids,
            logprobs=logprobs,
            policy_version=version,
            finish_reason="stop" if stopped else "length",
        )

    def generation_config(self, max_new_tokens: int) -> GenerationConfig:
        """The full sampler definition for one turn (public so trainers can mirror it)."""
        greedy = self.temperature == 0
        # Greedy runs no warpers; it gets HF's own defaults because any other value only
        # draws an "ignored flag" warning on every turn.
        return GenerationConfig(
            do_sample=not greedy,
            temperature=1.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p,
            top_k=50 if greedy else self.top_k,
            min_p=None if greedy else 0.0,  # 0.0 keeps everything yet overrides a model default
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(self.stop_ids),
            pad_token_id=_pad_id(self.tokenizer, self.stop_ids),
            output_scores=True,
            return_dict_in_generate=True,
            **_NEUTRAL,
        )

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
        """(completion ids, sampler logprobs) per prompt, each cut after its first stop token."""
        device = self.model.device
        width = max(len(p) for p in prompts)
        pad = _pad_id(self.tokenizer, self.stop_ids)
        # Left padding puts every prompt's last token in the same column, so new tokens line
        # up; the mask hides the pads and HF derives position ids from it.
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long, device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device)
        config = self.generation_config(max_new_tokens)
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=self.seed is not None):
            if self.seed is not None:
                torch.manual_seed(self.seed + self._calls)
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        self._calls += 1
        scores = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        results = []
        for row, ids in enumerate(out.sequences[:, width:].tolist()):
            # A row that stopped early is padded (often with a stop id) until the batch ends.
            n = next((i + 1 for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
            results.append((ids[:n], scores[row, :n].float().tolist()))
        return results


def _pad_id(tokenizer: Any, stop_ids: set[int]) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids)
