"""Weight sync on CUDA: a trainer's fp32 weights published as bf16 deltas from the GPU and
applied to a bf16 engine whose decode runs as CUDA graphs (written in place, so the graphs
stay valid): bit-exact weights, the same greedy tokens as an engine built from the trainer,
tokens tagged with the version that produced them, MoE expert tensors included (with the
publisher's previous version kept in host memory).

Run on a GPU box: ``PYTHONPATH=src python -m pytest -q tests/gpu/test_sync_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

from opencomposer.bench.toolkit import random_model
from opencomposer.inference.engine.core import Engine, SamplingParams
from opencomposer.sync import codec
from opencomposer.sync.publisher import WeightPublisher
from opencomposer.sync.store import FileStore
from opencomposer.sync.subscriber import WeightSubscriber

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = SamplingParams(max_tokens=16, temperature=0)


def _step(model, seed: int, lr: float) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), device="cuda", generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()


def _exact(engine, model) -> bool:
    sd = model.state_dict()
    views = engine.weight_views({k: v.shape for k, v in sd.items()})
    return all(torch.equal(codec.bits(v), codec.bits(sd[k].to(torch.bfloat16))) for k, v in views.items())


def test_bf16_graph_engine_follows_a_cuda_trainer(tmp_path):
    trainer = random_model("qwen2.5-0.5b", "cuda", torch.float32)
    engine = Engine(trainer, None, dtype=torch.bfloat16, max_num_seqs=8, max_model_len=512)
    assert engine.stats()["cuda_graph_batch_sizes"], "decode should run as CUDA graphs"
    store = FileStore(tmp_path)
    pub, sub = WeightPublisher(store, dtype=torch.bfloat16), WeightSubscriber(store)
    pub.publish(trainer.state_dict(), 0)
    sub.poll(engine)
    prompt = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0))
    for _ in range(6):
        engine.step()
    for v, lr in ((1, 1e-6), (2, 1e-5)):
        _step(trainer, v, lr)
        stats = pub.publish(trainer.state_dict(), v)
        assert stats["kind"] == "delta" and stats["compression"] > 3, stats
        res = sub.poll(engine)
        assert res["chain"] == [v] and _exact(engine, trainer), res
    while engine.has_unfinished():
        engine.step()
    c = engine.completion(rid)
    assert c.policy_versions[0] == 0 and c.policy_versions[-1] == 2
    fresh = Engine(trainer, None, dtype=torch.bfloat16, max_num_seqs=8, max_model_len=512)
    assert engine.generate([prompt], GREEDY)[0].token_ids == fresh.generate([prompt], GREEDY)[0].token_ids


def test_moe_expert_tensors_sync_exactly(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, norm_topk_prob=True)
    torch.manual_seed(0)
    trainer = Qwen3MoeForCausalLM(cfg).to("cuda").eval()
    engine = Engine(trainer, None, dtype=torch.bfloat16, max_num_seqs=4, max_model_len=256)
    store = FileStore(tmp_path)
    # the previous version kept in pinned host memory (keep_on="cpu"), copied over per diff
    pub, sub = WeightPublisher(store, dtype=torch.bfloat16, keep_on="cpu"), WeightSubscriber(store)
    pub.publish(trainer.state_dict(), 0)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in pub.prev.values())
    sub.poll(engine)
    _step(trainer, 1, 1e-4)
    pub.publish(trainer.state_dict(), 1)
    assert sub.poll(engine)["changed_tensors"] > 0 and _exact(engine, trainer)
