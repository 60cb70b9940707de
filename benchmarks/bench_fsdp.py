"""The sharded (FSDP2) trainer on 1, 2, 4 ... GPUs: tokens/s, MFU, memory per GPU, equal losses.

    PYTHONPATH=src python benchmarks/bench_fsdp.py --shape qwen2.5-1.5b --worlds 1,2,4
    PYTHONPATH=src python benchmarks/bench_fsdp.py --shape tiny --worlds 1,2 --device cpu --seq-len 64 --batch 4

The measuring lives in ``opencomposer.bench.fsdp``; see its docstring. Last line: one JSON object.
"""

from opencomposer.bench.fsdp import main

if __name__ == "__main__":
    main()
