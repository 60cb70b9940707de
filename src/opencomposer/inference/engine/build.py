"""How an ``Engine``'s options become its parts: its own model, the kernels, the KV cache's size,
CUDA graphs for a MoE model, and a clear error when the cache and graphs do not fit the GPU.
``Engine.__init__`` (``core.py``) calls these in turn, then ``decode_modes`` (speculative
decoding, run-ahead).

    model, eos_ids = engine_model(hf_model, tokenizer, device="cuda", dtype=torch.bfloat16)
    kv_blocks = kv_blocks_for(model, None, max_model_len=4096, max_num_seqs=64, block_size=16, fraction=0.8)
    kernels, cuda_graphs, gemv = choose_kernels(model, None, True, None)
    runner = build_runner(model, kv_blocks, 16, 64, 4096, 8192, cuda_graphs=cuda_graphs, kernels=kernels,
                          gemv=gemv, pdl=None, max_num_seqs=64, kv_source="kv_blocks as given")

Options: ``kernels="triton"`` (default on CUDA) uses the fused Triton kernels of
``kernels/fused.py``; ``"torch"`` is the portable path (the only one on CPU). ``cuda_graphs``
captures decode steps on CUDA (sampling included); a MoE model keeps them only where its grouped
GEMMs can be captured (``models/moe.py``). ``gemv`` (Triton, CUDA): batch-1 decode with the
fused small-batch projections of ``kernels/gemv.py``; None (default) times them against cuBLAS
at capture and keeps the faster. ``kv_blocks`` defaults to 80% of free GPU memory on CUDA
(capped at twice what ``max_num_seqs`` full-length sequences need) and to at most 1 GiB on CPU.

Test: ``pytest tests/unit/inference/test_engine.py``; GPU (out of memory at start-up):
``pytest tests/gpu/test_engine_cuda.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from opencomposer.inference.engine.model_runner import ModelRunner
from opencomposer.inference.engine.prefill_layout import prefill_buckets
from opencomposer.inference.models.moe import grouped_mm_capturable, grouped_mm_works
from opencomposer.inference.models.transformer import DecoderLM, from_hf_model


def engine_model(model: Any, tokenizer: Any, device: str | torch.device | None,
                 dtype: torch.dtype | None) -> tuple[DecoderLM, frozenset[int]]:
    """The engine's own model in eval mode (a ``DecoderLM`` as given, moved; a Hugging Face
    ``*ForCausalLM``'s weights copied into one) and the end-of-turn token ids."""
    if isinstance(model, DecoderLM):
        own = model if device is None and dtype is None else model.to(device=device, dtype=dtype)
        eos_source = SimpleNamespace(generation_config=None)
    else:  # a Hugging Face *ForCausalLM: copy its weights into the engine's own model
        own = from_hf_model(model, device=device, dtype=dtype)
        eos_source = model
    own.eval()
    return own, _eos_ids(eos_source, tokenizer)


def kv_block_bytes(model: DecoderLM, block_size: int) -> int:
    """Bytes of one KV-cache block: K and V of ``block_size`` tokens in every layer."""
    cfg = model.cfg
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * \
        next(model.parameters()).element_size()


def kv_blocks_for(model: DecoderLM, kv_blocks: int | None, max_model_len: int, max_num_seqs: int,
                  block_size: int, fraction: float) -> int:
    """``kv_blocks`` as given, or the default: room for every sequence plus as much cached
    prefix, within ``fraction`` of free GPU memory (``cpu_kv_bytes`` on a CPU); at least one full sequence."""
    blocks_per_seq = -(-max_model_len // block_size)
    if kv_blocks is None:
        per_block = kv_block_bytes(model, block_size)
        want = max_num_seqs * blocks_per_seq * 2  # room for every sequence plus as much cached prefix
        device = next(model.parameters()).device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            kv_blocks = max(blocks_per_seq, min(want, int(free * fraction) // per_block))
        else:
            kv_blocks = max(blocks_per_seq, min(want, cpu_kv_bytes() // per_block))
    if kv_blocks < blocks_per_seq:
        raise ValueError(f"kv_blocks={kv_blocks} cannot hold one sequence of max_model_len={max_model_len} "
                         f"({blocks_per_seq} blocks of {block_size})")
    return kv_blocks


def cpu_kv_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The CPU's paged-cache budget: an eighth of the memory available now, within 1-4 GiB. The
    decode mirror may take as much again (``decode_mirror``), so a batch of long contexts decodes
    without gathering blocks (12 rows of 2.6k tokens, SmolLM2-135M, 2-core VM: 1.28x faster
    decode with 2.75 GiB than with 1 GiB, where the mirror did not fit)."""
    available = 0
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    return max(1 << 30, min(4 << 30, available // 8))


def choose_kernels(model: DecoderLM, kernels: str | None, cuda_graphs: bool | str,
                   gemv: bool | None) -> tuple[str, bool | str, bool | None]:
    """-> (kernels, cuda_graphs, gemv) this model and device run: Triton by default on CUDA
    (power-of-two head dims); a MoE model without the batch-1 GEMV plan, and without CUDA
    graphs where its experts cannot be captured (it also picks the experts' kernels here)."""
    cfg = model.cfg
    device = next(model.parameters()).device
    pow2 = cfg.head_dim & (cfg.head_dim - 1) == 0
    if cfg.sparse_layers:  # MoE: grouped GEMMs where this build runs them, else a loop (``moe.py``)
        model_dtype = next(model.parameters()).dtype
        grouped = grouped_mm_works(device, model_dtype)
        model.use_grouped_mm(grouped)
        gemv = False  # the batch-1 GEMV plan is for dense MLPs
        if cuda_graphs is True and device.type == "cuda" and not (
                grouped and grouped_mm_capturable(device, model_dtype)):
            cuda_graphs = False  # the experts' loop (or grouped GEMMs' fallback) syncs with the host
    kernels = kernels or ("triton" if device.type == "cuda" and pow2 and _has_triton() else "torch")
    if kernels not in ("torch", "triton") or (kernels == "triton" and device.type != "cuda"):
        raise ValueError(f"kernels={kernels!r}: expected 'torch', or 'triton' on a CUDA device")
    return kernels, cuda_graphs, gemv


def build_runner(model: DecoderLM, kv_blocks: int, block_size: int, graph_rows: int, max_model_len: int,
                 budget: int, *, cuda_graphs: bool | str, kernels: str, gemv: bool | None, pdl: bool | None,
                 max_num_seqs: int, kv_source: str) -> ModelRunner:
    """The ``ModelRunner`` (KV cache, CUDA graphs); running out of GPU memory building it is a
    ``ValueError`` that says what did not fit (``kv_source``: where ``kv_blocks`` came from)."""
    try:
        return ModelRunner(model, kv_blocks, block_size, graph_rows, max_model_len,
                           cuda_graphs=cuda_graphs, triton=kernels == "triton", gemv=gemv, pdl=pdl,
                           max_num_batched_tokens=budget)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        raise ValueError(  # settings the GPU cannot hold, as the other limits checked here
            f"out of GPU memory building the engine: a KV cache of {kv_blocks} blocks "
            f"({kv_blocks * kv_block_bytes(model, block_size) / 2**30:.2f} GiB, {kv_source}) and the CUDA graphs "
            f"(decode up to max_num_seqs={max_num_seqs} rows, prefill steps up to {prefill_buckets(budget)[-1]} "
            f"tokens) do not fit. Lower kv_memory_fraction or kv_blocks, max_num_batched_tokens or "
            f"max_num_seqs, or pass cuda_graphs=False"
        ) from e


def decode_graph_rows(max_num_seqs: int, draft: Any, num_draft: int, spec_max_batch: int) -> int:
    """Rows of the largest decode graph: ``max_num_seqs``, or more when drafting (a speculative
    step verifies ``num_draft + 1`` rows a sequence in a decode graph, ``spec_graph.py``)."""
    if draft is None:
        return max_num_seqs
    from opencomposer.inference.engine.speculate import check_settings

    check_settings(num_draft, spec_max_batch)
    return max(max_num_seqs, spec_max_batch * (num_draft + 1))


def decode_modes(model: DecoderLM, runner: ModelRunner, draft: Any, num_draft: int, spec_max_batch: int,
                 run_ahead: bool | None) -> tuple[Any, bool]:
    """-> (the ``Speculator`` of ``draft``, an ``MTPHead`` or its directory, or None; whether
    decode steps run ahead: by default wherever decode graphs exist, never when drafting)."""
    speculator = None
    if draft is not None:  # speculative decoding (``speculate.py``)
        from opencomposer.inference.engine.speculate import Speculator

        if run_ahead:
            raise ValueError("run_ahead=True and draft=: speculative decode steps are not launched ahead")
        speculator, run_ahead = Speculator(model, draft, num_draft, spec_max_batch), False
        speculator.attach(runner)
    run_ahead = bool(runner.graphs) if run_ahead is None else bool(run_ahead)
    if run_ahead and not runner.graphs:
        raise ValueError("run_ahead=True needs decode graphs: cuda_graphs=True on a CUDA device, "
                         "or cuda_graphs='eager'")
    return speculator, run_ahead


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    if tokenizer is None:
        return frozenset()
    from opencomposer.models.chat import stop_token_ids  # the one definition of end-of-turn ids

    return frozenset(stop_token_ids(model, tokenizer))


def _out_of_memory(e: BaseException | None) -> bool:
    """Is ``e``, or an exception it was raised from or during, a CUDA out-of-memory error (a
    graph capture that ran out of memory can surface as a failed capture, the OOM as its cause)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower():
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
