"""The rollout / serving engine and the OpenAI-compatible server, in four subpackages:

* ``engine/``   the Engine and its parts, one class per role as in vLLM / nano-vllm:
  ``core.py`` (Engine: add_request / step / generate / abort / update_weights / stats),
  ``build.py`` (options -> parts), ``outputs.py`` (StepOutput, Completion, stop rules),
  ``scheduler.py`` (continuous batching), ``block_manager.py`` (paged KV cache, prefix caching),
  ``model_runner.py`` (KV tensors, batch -> tensors, graph replays), ``graph_capture.py`` (CUDA
  graphs), ``run_ahead.py`` (decode steps launched ahead), ``sampler.py``,
  ``speculate.py`` (MTP-head speculative decoding), ``loop.py`` (one thread owns the engine).
* ``models/``   the engine's own model definitions with paged attention (``transformer.py``,
  ``moe.py``, ``attention.py``: the torch path, CPU and CUDA).
* ``kernels/``  Triton kernels for CUDA, each with a torch equivalent used on CPU (``fused.py``,
  ``gemv.py``, ``prefill.py``, ``sample.py``, ``moe.py``).
* ``server/``   ``opencomposer serve``: the OpenAI wire format, the front door of the real-time
  loop (session logs, feedback, A/B arms, weight hot-swap) and auth.

    from opencomposer.inference.engine.core import Engine, SamplingParams
    engine = Engine(model, tokenizer)
    [out] = engine.generate([prompt_ids], SamplingParams(max_tokens=64))

The policies that put the engine or a server behind the harness are in ``policies/``; the
benchmarks in ``bench/`` (``opencomposer bench engine``). Nothing here imports pydantic (the GPU
box has none): ``PYTHONPATH=src python -m opencomposer.bench.engine`` runs with torch +
transformers (+ triton) only.

Test: ``pytest tests/unit/inference -q`` (CPU); ``tests/gpu`` on CUDA.
"""
