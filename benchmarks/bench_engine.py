"""Engine benchmark (decode at batch 1/64/256, prefill, prefix cache, parity) vs HF and the roofline.

    PYTHONPATH=src python benchmarks/bench_engine.py --shapes qwen2.5-0.5b,qwen2.5-1.5b --out engine.json
    opencomposer bench engine            # the same, through the CLI

All the measuring lives in ``opencomposer.bench.engine`` (so the CLI and this script run
the same code); see its docstring for what each figure means. Last line: one JSON object.
"""

from opencomposer.bench.engine import main

if __name__ == "__main__":
    main()
