"""MoE decode (Qwen3-MoE shapes): the engine vs its experts' loop, HF generate and the roofline.

    PYTHONPATH=src python benchmarks/bench_moe.py --layers 8 --out moe.json
    PYTHONPATH=src python benchmarks/bench_moe.py --full          # Qwen3-30B-A3B at full depth, engine only
    opencomposer bench moe                                        # the same, through the CLI

The measuring lives in ``opencomposer.bench.moe``; see its docstring. Last line: one JSON object.
"""

from opencomposer.bench.moe import main

if __name__ == "__main__":
    main()
