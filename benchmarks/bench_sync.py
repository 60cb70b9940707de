"""Weight sync, trainer -> store -> a decoding engine: bytes and seconds per version, exactness.

    PYTHONPATH=src python benchmarks/bench_sync.py --shape qwen2.5-1.5b --out sync.json
    PYTHONPATH=src python benchmarks/bench_sync.py --shape tiny --device cpu     # quick check
    opencomposer bench sync                                                      # the same, through the CLI

The measuring lives in ``opencomposer.bench.sync``; see its docstring. Last line: one JSON object.
"""

from opencomposer.bench.sync import main

if __name__ == "__main__":
    main()
