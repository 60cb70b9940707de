"""Trainer -> store -> engine: versions published as deltas and applied in flight, exactly."""

from __future__ import annotations

import json

import pytest
import torch

from opencomposer.inference.engine.core import SamplingParams
from opencomposer.sync import codec
from opencomposer.sync.layout import scan
from opencomposer.sync.publisher import WeightPublisher
from opencomposer.sync.subscriber import SyncError, WeightFollower, WeightSubscriber

from .conftest import train_step

GREEDY = SamplingParams(max_tokens=8, temperature=0)
PROMPT = [5, 17, 33, 9, 41, 12, 7]


def _same_weights(engine, model, dtype) -> None:
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not model.config.tie_word_embeddings}
    views = engine.weight_views({k: v.shape for k, v in sd.items()})
    for name, view in views.items():
        assert torch.equal(codec.bits(view), codec.bits(sd[name].to(dtype))), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_engine_follows_the_trainer_exactly(trainer_model, make_engine, store, dtype):
    engine = make_engine(dtype)
    pub, sub = WeightPublisher(store, dtype=dtype, full_every=100), WeightSubscriber(store)
    first = pub.publish(trainer_model.state_dict(), 0)
    assert first["kind"] == "full" and first["stored_bytes"] < first["raw_bytes"]
    assert sub.poll(engine)["from_full"] and engine.policy_version == 0
    for v in (1, 2, 3):
        train_step(trainer_model, seed=v, lr=1e-5)
        stats = pub.publish(trainer_model.state_dict(), v)
        assert stats["kind"] == "delta"
        if dtype == torch.bfloat16:  # few bf16 values move in a small step: a small delta
            assert stats["changed_fraction"] < 0.5 and stats["compression"] > 2
        res = sub.poll(engine)
        assert res["chain"] == [v] and not res["from_full"] and res["changed_tensors"] > 0
        _same_weights(engine, trainer_model, dtype)
    assert sub.poll(engine) is None  # nothing new
    # the engine now samples what an engine built from the trainer's weights samples
    fresh = make_engine(dtype).generate([PROMPT], GREEDY)[0]
    assert engine.generate([PROMPT], GREEDY)[0].token_ids == fresh.token_ids


def test_a_running_sequence_continues_on_the_new_version(trainer_model, make_engine, store):
    engine = make_engine()
    pub, sub = WeightPublisher(store, dtype=torch.float32), WeightSubscriber(store)
    pub.publish(trainer_model.state_dict(), 0)
    sub.poll(engine)
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=12, temperature=0))
    for _ in range(4):
        engine.step()
    train_step(trainer_model, seed=1)
    pub.publish(trainer_model.state_dict(), 1)
    assert sub.poll(engine)["version"] == 1
    while engine.has_unfinished():
        engine.step()
    out = engine.completion(rid)
    assert len(out.token_ids) == 12 and out.policy_versions[0] == 0 and out.policy_versions[-1] == 1
    assert engine.stats()["kv_blocks_used"] == 0


def test_a_late_follower_catches_up_and_old_versions_are_collected(trainer_model, make_engine, store):
    pub = WeightPublisher(store, dtype=torch.bfloat16, full_every=3, keep_full=2)
    early, late = make_engine(torch.bfloat16), make_engine(torch.bfloat16)
    sub_early, sub_late = WeightSubscriber(store), WeightSubscriber(store)
    kinds = {}
    for v in range(8):
        if v:
            train_step(trainer_model, seed=v, lr=1e-5)
        kinds[v] = pub.publish(trainer_model.state_dict(), v)["kind"]
        if v == 4:
            assert sub_early.poll(early)["chain"] == [3, 4]  # the newest full, then deltas
    assert [v for v, k in kinds.items() if k == "full"] == [0, 3, 6]
    done, _ = scan(store.list())
    assert [e.version for e in done] == [3, 4, 5, 6, 7]  # before the 2nd-newest full: deleted
    assert sub_early.poll(early)["chain"] == [5, 6, 7]  # deltas from where it was
    assert sub_late.poll(late)["chain"] == [6, 7]  # the newest full snapshot, then deltas
    for engine in (early, late):
        _same_weights(engine, trainer_model, torch.bfloat16)


def test_a_resumed_trainer_starts_a_timeline_and_followers_move_to_it(trainer_model, make_engine, store):
    engine = make_engine(torch.bfloat16)
    sub = WeightSubscriber(store)
    pub = WeightPublisher(store, dtype=torch.bfloat16)
    for v in range(4):
        train_step(trainer_model, seed=v, lr=1e-5)
        pub.publish(trainer_model.state_dict(), v)
    sub.poll(engine)
    assert (sub.timeline, sub.version) == (pub.timeline, 3)
    # the run crashed after version 3 and resumes from its version-2 checkpoint, other weights
    train_step(trainer_model, seed=99, lr=1e-3)
    resumed = WeightPublisher(store, dtype=torch.bfloat16)
    resumed.publish(trainer_model.state_dict(), 3)
    assert {e.timeline for e in scan(store.list())[0] if e.version >= 3} == {resumed.timeline}
    res = sub.poll(engine)
    assert res["from_full"] and res["timeline"] == resumed.timeline
    _same_weights(engine, trainer_model, torch.bfloat16)


def test_weights_changed_behind_the_followers_back_are_detected_and_reloaded(trainer_model, make_engine, store):
    engine = make_engine(torch.bfloat16)
    pub, sub = WeightPublisher(store, dtype=torch.bfloat16), WeightSubscriber(store)
    pub.publish(trainer_model.state_dict(), 0)
    sub.poll(engine)
    with torch.no_grad():  # same version number, other weights (a bad manual edit)
        for view in engine.weight_views({"model.norm.weight": (64,)}).values():
            view.add_(1.0)
    train_step(trainer_model, seed=1, lr=1e-2)
    pub.publish(trainer_model.state_dict(), 1)
    assert sub.poll(engine)["from_full"] and sub.counts["recoveries"] == 1
    _same_weights(engine, trainer_model, torch.bfloat16)
    # another writer (an admin swap) changed the version: the next poll starts from a full one
    engine.update_weights({}, 7)
    train_step(trainer_model, seed=2, lr=1e-2)
    pub.publish(trainer_model.state_dict(), 2)
    assert sub.poll(engine)["chain"] == [0, 1, 2]


def test_damaged_or_unfinished_versions_never_reach_the_engine(trainer_model, make_engine, store):
    engine = make_engine(torch.bfloat16)
    pub = WeightPublisher(store, dtype=torch.bfloat16)
    pub.publish(trainer_model.state_dict(), 0)
    sub = WeightSubscriber(store)
    sub.poll(engine)
    train_step(trainer_model, seed=1, lr=1e-2)
    pub.publish(trainer_model.state_dict(), 1)
    blob = next(k for k in store.list() if k.startswith("0000000001") and k.endswith(".bin"))
    data = bytearray(store.get(blob))
    data[len(data) // 2] ^= 0xFF
    store.put(blob, bytes(data))
    before = {k: v.clone() for k, v in engine.weight_views({"model.norm.weight": (64,)}).items()}
    with pytest.raises(SyncError, match=r"0000000001-\w+-delta/rank00000-of-00001.bin: .*damaged payload"):
        sub.poll(engine)
    assert engine.policy_version == 0
    assert all(torch.equal(v, engine.weight_views({k: v.shape})[k]) for k, v in before.items())
    # a follower thread counts the error and keeps serving version 0
    follower = WeightFollower(sub, engine, every_s=0.05).start()
    try:
        import time
        deadline = time.time() + 10
        while follower.errors == 0 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        follower.stop()
    assert follower.errors >= 1 and "damaged payload" in follower.stats()["last_error"]
    # a part whose manifest is not written yet (upload in progress) is not a version
    store.put("0000000009-" + pub.timeline + "-delta/rank00000-of-00001.bin", b"partial")
    assert sub.latest().version == 1


def test_ranks_publish_their_own_tensors_and_a_version_needs_all_of_them(trainer_model, make_engine, store):
    sd = trainer_model.state_dict()
    names = [n for n in sd if n != "lm_head.weight"]
    parts = [{n: sd[n] for n in names[r::2]} for r in range(2)]
    pubs = [WeightPublisher(store, dtype=torch.bfloat16, rank=r, world=2, timeline="run7") for r in range(2)]
    engine, sub = make_engine(torch.bfloat16), WeightSubscriber(store)
    pubs[0].publish(parts[0], 0)
    assert sub.poll(engine) is None  # rank 1's part is missing
    pubs[1].publish(parts[1], 0)
    assert sub.poll(engine)["version"] == 0
    _same_weights(engine, trainer_model, torch.bfloat16)


def test_bad_publisher_input_is_refused(trainer_model, store):
    pub = WeightPublisher(store, dtype=torch.bfloat16)
    pub.publish(trainer_model.state_dict(), 5)
    with pytest.raises(ValueError, match="version 5: this publisher already published 5"):
        pub.publish(trainer_model.state_dict(), 5)
    with pytest.raises(ValueError, match="rank 2 of world 2"):
        WeightPublisher(store, rank=2, world=2, timeline="x")
    with pytest.raises(ValueError, match="same timeline string on every rank"):
        WeightPublisher(store, rank=0, world=2)
    with pytest.raises(ValueError, match="no floating-point tensors"):
        WeightPublisher(store).publish({"step": torch.tensor(3)}, 1)
    manifest = json.loads(store.get(next(k for k in store.list() if k.endswith(".json"))))
    assert manifest["kind"] == "full" and manifest["dtype"] == "bfloat16"


def test_s3_store_end_to_end(trainer_model, make_engine):
    moto = pytest.importorskip("moto")
    import boto3

    from opencomposer.sync.store import S3Store
    with moto.mock_aws():
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="runs")
        store = S3Store("runs", "demo", client=boto3.client("s3", region_name="us-east-1"))
        engine = make_engine(torch.bfloat16)
        pub, sub = WeightPublisher(store, dtype=torch.bfloat16), WeightSubscriber(store)
        pub.publish(trainer_model.state_dict(), 0)
        train_step(trainer_model, seed=1, lr=1e-5)
        pub.publish(trainer_model.state_dict(), 1)
        assert sub.poll(engine)["chain"] == [0, 1]
        _same_weights(engine, trainer_model, torch.bfloat16)


def test_a_dtype_the_engine_does_not_run_in_is_refused_before_any_change(trainer_model, make_engine, store):
    engine = make_engine(torch.float32)
    before = {k: v.clone() for k, v in engine.weight_views({"model.norm.weight": (64,)}).items()}
    WeightPublisher(store, dtype=torch.bfloat16).publish(trainer_model.state_dict(), 4)
    with pytest.raises(SyncError, match=r"version 4 is torch.bfloat16 .* the engine runs in torch.float32"):
        WeightSubscriber(store).poll(engine)
    assert engine.policy_version == 0
    assert all(torch.equal(v, engine.weight_views({k: v.shape})[k]) for k, v in before.items())


def test_keep_on_is_checked(store):
    with pytest.raises(ValueError, match="keep_on='disk': expected 'device'"):
        WeightPublisher(store, keep_on="disk")


def test_a_blob_streams_with_a_one_byte_window(trainer_model, make_engine, store, monkeypatch):
    """The writer takes each tensor's frames as soon as the window is full (here: always)."""
    from opencomposer.sync import publisher
    monkeypatch.setattr(publisher, "WINDOW", 1)
    engine, pub, sub = make_engine(torch.bfloat16), WeightPublisher(store, dtype=torch.bfloat16), WeightSubscriber(store)
    pub.publish(trainer_model.state_dict(), 0)
    train_step(trainer_model, seed=1, lr=1e-5)
    stats = pub.publish(trainer_model.state_dict(), 1)
    assert sub.poll(engine)["chain"] == [0, 1] and stats["stored_bytes"] > 0
    _same_weights(engine, trainer_model, torch.bfloat16)


def test_a_failed_write_makes_the_next_version_a_full_snapshot(trainer_model, make_engine, store):
    """The publisher had already moved its record of the last version when the store failed:
    the next version is a full snapshot, so followers never apply a delta from an unseen base."""
    engine, sub = make_engine(torch.bfloat16), WeightSubscriber(store)
    pub = WeightPublisher(store, dtype=torch.bfloat16)
    pub.publish(trainer_model.state_dict(), 0)
    sub.poll(engine)
    real_put = store.put

    def failing(key, data):
        if key.endswith(".bin"):
            next(iter(data), None)  # the writer starts, then the disk is full
            raise OSError("No space left on device")
        real_put(key, data)
    store.put = failing
    train_step(trainer_model, seed=1, lr=1e-3)
    with pytest.raises(OSError, match="No space left"):
        pub.publish(trainer_model.state_dict(), 1)
    store.put = real_put
    train_step(trainer_model, seed=2, lr=1e-3)
    assert pub.publish(trainer_model.state_dict(), 2)["kind"] == "full"
    assert sub.poll(engine)["chain"] == [2] and sub.counts["recoveries"] == 0
    _same_weights(engine, trainer_model, torch.bfloat16)
