"""The rollout / serving engine and the OpenAI-compatible server.

Engine (``from opencomposer.inference.engine.core import Engine, SamplingParams``), one class
per role, as in vLLM / nano-vllm:

* ``engine.py``         Engine: add_request / step / generate / abort / update_weights / stats
* ``scheduler.py``      continuous batching: prefill (chunked) or decode steps, preemption
* ``block_manager.py``  paged KV cache bookkeeping and block-hash prefix caching
* ``model_runner.py``   KV cache tensors, batch -> tensors, CUDA graphs (decode, small prefill), run-ahead launches
* ``batch1_plan.py``    which kernel runs each batch-1 projection (GEMV or cuBLAS), chosen on whole-graph time
* ``models/transformer.py``  Llama / Qwen2 / Qwen3 with paged attention, loads HF state dicts
* ``attention.py``      paged attention, torch path (CPU and CUDA)
* ``triton_kernels.py`` fused CUDA kernels (decode attention, rotary + cache write, add + RMSNorm, SiLU * up),
  programmatic dependent launch; ``triton_gemv.py`` batch-1 GEMV; ``triton_prefill.py`` paged
  prefill attention; ``triton_sample.py`` in-graph sampling
* ``sampler.py``        temperature / top-k / top-p / seeds, per-token logprobs
* ``policy.py``         EnginePolicy: the engine behind ModelPolicy's interface, for rollouts
* ``bench.py``          ``opencomposer bench engine``

Nothing here imports pydantic (the GPU box has none): ``PYTHONPATH=src python
benchmarks/bench_engine.py`` runs with torch + transformers (+ triton) only.
"""
