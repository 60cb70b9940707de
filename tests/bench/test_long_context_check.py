"""benchmarks/long_context_check.py: on a model extended 4x by YaRN, the engine's greedy tokens equal
HF's at prompts past the native context; a prompt past the extended context is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
lcc = load_benchmark("long_context_check")


@pytest.fixture(scope="module")
def extended(tmp_path_factory) -> Path:
    from opencomposer.models.registry import load_model
    from opencomposer.train.long_context import extend_context

    hf, tok = load_model("tiny-random")
    native = hf.config.max_position_embeddings
    extend_context(hf, 4.0)
    assert hf.config.max_position_embeddings == 4 * native
    out = tmp_path_factory.mktemp("extended")
    hf.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_engine_equals_hf_past_the_native_context(extended, capsys):
    assert lcc.main(["--model", str(extended), "--data", str(ROOT / "src" / "opencomposer"), "--lengths", "300", "3000",
                     "--new-tokens", "6", "--device", "cpu"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["rope_type"] == "yarn" and res["factor"] == 4.0 and res["context"] == 4 * res["native_context"]
    assert [r["prompt_tokens"] for r in res["rows"]] == [300, 3000] and 3000 > res["native_context"]
    assert res["all_equal"] and all(r["equal"] == r["of"] == 6 for r in res["rows"])


def test_a_prompt_past_the_context_is_refused(extended):
    with pytest.raises(SystemExit, match=r"past the model's context"):
        lcc.main(["--model", str(extended), "--data", str(ROOT / "src"), "--lengths", "100000", "--device", "cpu"])
