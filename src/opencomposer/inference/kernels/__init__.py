"""Triton kernels for the engine on CUDA, each with a torch equivalent used on the CPU.

``fused.py`` (paged decode attention, fused norms and rotary), ``gemv.py`` (batch-1 linear layers),
``prefill.py`` (paged prefill attention), ``sample.py`` (fused sampling) and ``moe.py`` (a MoE layer
for a few tokens). The engine picks them when it runs on CUDA; ``triton`` is imported lazily.

Test: ``pytest tests/unit/inference/test_triton_cpu.py tests/unit/inference/test_prefill_host.py -q``
(the Triton interpreter on the CPU); ``pytest tests/gpu -q`` on CUDA.
"""
