"""Speculative decoding with an MTP head against plain decoding.

    PYTHONPATH=src python benchmarks/bench_spec.py --head runs/mtp/head          # embedded model, CPU
    PYTHONPATH=src python benchmarks/bench_spec.py --shape qwen2.5-1.5b          # step costs on a GPU
    opencomposer bench spec --head runs/mtp/head                                 # the same, through the CLI

The measuring lives in ``opencomposer.bench.spec``; see its docstring. Last line: one JSON object.
"""

from opencomposer.bench.spec import main

if __name__ == "__main__":
    main()
