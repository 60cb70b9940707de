"""Benchmarks behind ``opencomposer bench ...``: each module measures one part against a baseline.

    opencomposer bench engine     # engine.py: engine throughput against HF ``generate`` and the roofline
    opencomposer bench sync       # sync.py: weight sync from a trainer to a decoding engine
    opencomposer bench spec       # spec.py: speculative decoding with an MTP head against plain decoding
    opencomposer bench sandbox    # sandbox.py: sandbox latency and capacity on a real repository
    opencomposer bench moe        # moe.py: MoE decode against the experts' loop and Hugging Face

``fsdp.py`` and ``checkpoint.py`` are the sharded trainer's throughput and checkpoint cost (GPU).
Benchmarks sit in the top layer with ``cli``: they may import any package, and none below imports them.

Test: ``pytest tests/bench/test_engine_bench.py tests/bench/test_sandbox_bench.py -q``.
"""
