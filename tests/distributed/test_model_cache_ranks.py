"""A model cache built by a torchrun rank other than 0 (``models/registry.py``): transformers writes a
model's files on rank 0 only once torch.distributed is up, so a rank 1 that won the build lock left
a tree of tokenizer files and failed to load it (CI, twice). Two gloo ranks; rank 1 builds tiny-random
in an empty cache while rank 0 waits, then both load it.

Run: ``pytest tests/distributed/test_model_cache_ranks.py`` (about 20 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, torch.distributed as dist
dist.init_process_group("gloo")
from opencomposer.models import load_model
from opencomposer.models.registry import model_cache_dir
if dist.get_rank() == 1:
    load_model("tiny-random")  # rank 1 builds the cache alone
dist.barrier()
model, tok = load_model("tiny-random")  # both read it
if dist.get_rank() == 0:
    print(json.dumps({"params": sum(p.numel() for p in model.parameters()),
                      "files": sorted(p.name for p in model_cache_dir("tiny-random").iterdir())}))
dist.barrier()
dist.destroy_process_group()
"""


def test_a_rank_other_than_0_builds_a_whole_model_cache(tmp_path):
    script = tmp_path / "build.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OPENCOMPOSER_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"config.json", "model.safetensors", "tokenizer.json", "opencomposer.json"} <= set(got["files"])
    assert got["params"] > 0
