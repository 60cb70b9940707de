"""The rollout and serving engine, one module per role as in vLLM / nano-vllm: ``core.py`` (``Engine``:
schedule -> run -> post-process), ``build.py`` (options -> parts), ``scheduler.py``, ``block_manager.py``,
``model_runner.py`` (batch -> tensors, graph replays), ``graph_capture.py``, ``run_ahead.py``,
``sampler.py``, ``outputs.py``, ``speculate.py`` / ``spec_graph.py`` / ``acceptance.py``, ``loop.py``.

    from opencomposer.inference.engine.core import Engine, SamplingParams

Test: ``pytest tests/unit/inference``; on CUDA ``pytest tests/gpu``.
"""
