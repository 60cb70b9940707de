"""Engine behaviour on a tiny Qwen2 (CPU, fp32): continuous batching, prefix cache,
preemption, abort, stop conditions, seeds, in-flight weight updates, bad input.
Every test ends with no KV block in use (nothing leaked)."""

from __future__ import annotations

import pytest
import torch

from opencomposer.inference.engine.core import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0)


@pytest.fixture
def hf(tiny_hf):
    return tiny_hf("qwen2")


def _alone(hf, prompt, params=GREEDY):
    return Engine(hf, None, max_model_len=128).generate([prompt], params)[0]


def test_requests_joining_mid_run_get_the_same_tokens_as_alone(hf, prompts):
    ps = prompts(4, seed=5)
    engine = Engine(hf, None, max_num_seqs=3, max_model_len=128, block_size=4)
    rids = [engine.add_request(ps[0], GREEDY), engine.add_request(ps[1], GREEDY)]
    for _ in range(3):
        engine.step()
    rids += [engine.add_request(ps[2], GREEDY), engine.add_request(ps[3], GREEDY)]  # 4 > max_num_seqs: one waits
    seen_running = 0
    while engine.has_unfinished():
        engine.step()
        seen_running = max(seen_running, engine.stats()["running"])
    assert seen_running == 3
    for p, rid in zip(ps, rids):
        assert engine.completion(rid).token_ids == _alone(hf, p).token_ids
    assert engine.stats()["kv_blocks_used"] == 0


def test_prefix_cache_reuses_the_shared_history(hf, prompts):
    engine = Engine(hf, None, max_model_len=256, block_size=8)
    history = prompts(1, lo=60, hi=61, seed=6)[0]
    first = engine.generate([history], GREEDY)[0]
    assert first.cached_prompt_tokens == 0
    # the next turn resends the history, the reply and a new message
    turn2 = history + first.token_ids + [5, 6, 7, 8, 9]
    second = engine.generate([turn2], GREEDY)[0]
    assert second.cached_prompt_tokens == (len(history) + len(first.token_ids)) // 8 * 8 > 0
    assert second.token_ids == _alone(hf, turn2).token_ids  # reused K/V gives the same answer
    assert engine.stats()["prefill_tokens_computed"] == len(history) + len(turn2) - second.cached_prompt_tokens
    assert engine.stats()["kv_blocks_used"] == 0


def test_the_next_turn_finds_its_history_through_the_finished_requests_line(hf, prompts):
    """A finished request is remembered (``BlockManager`` lines): the next turn takes its blocks
    without hashing them again, and answers as if computed alone."""
    engine = Engine(hf, None, max_model_len=256, block_size=4)
    history = prompts(1, lo=100, hi=101, seed=7)[0]
    first = engine.generate([history], GREEDY)[0]  # computes 100 + 9 tokens: 27 full blocks
    assert engine.stats()["prefix_cache_line_hit_tokens"] == 0
    turn2 = history + first.token_ids + [5, 6, 7, 8, 9]
    second = engine.generate([turn2], GREEDY)[0]
    assert second.cached_prompt_tokens == engine.stats()["prefix_cache_line_hit_tokens"] == 27 * 4
    assert second.token_ids == _alone(hf, turn2).token_ids
    assert engine.stats()["kv_blocks_used"] == 0


def test_a_group_sharing_a_prompt_computes_it_once_with_the_same_outputs(hf, prompts):
    """Rollouts of one task submitted together (a GRPO group, or n > 1): the shared prompt's
    blocks are computed by the first and reused within the same step by the others."""
    engine = Engine(hf, None, max_model_len=256, block_size=8)
    shared = prompts(1, lo=61, hi=62, seed=9)[0]  # 7 full blocks and 5 tokens
    group = [shared, shared + [3, 4], shared, shared[:40] + [7] * 9]
    outs = engine.generate(group, GREEDY)
    assert [c.cached_prompt_tokens for c in outs] == [0, 56, 56, 40]
    assert engine.stats()["prefill_tokens_computed"] == 61 + 7 + 5 + 9
    for p, c in zip(group, outs):
        alone = _alone(hf, p)
        assert c.token_ids == alone.token_ids
        assert max(abs(a - b) for a, b in zip(c.logprobs, alone.logprobs)) < 1e-4
    assert engine.stats()["kv_blocks_used"] == 0


def test_preemption_when_the_cache_is_full_keeps_outputs_exact(hf, prompts):
    ps = prompts(4, lo=20, hi=30, seed=7)
    params = SamplingParams(max_tokens=24, temperature=0)
    engine = Engine(hf, None, max_model_len=64, block_size=4, kv_blocks=26)  # fits ~2 sequences
    outs = engine.generate(ps, params)
    assert engine.stats()["preemptions"] > 0
    for p, c in zip(ps, outs):
        assert c.token_ids == _alone(hf, p, params).token_ids
    assert engine.stats()["kv_blocks_used"] == 0


def test_abort_mid_generation_frees_blocks(hf, prompts):
    engine = Engine(hf, None, max_model_len=128, block_size=4)
    a = engine.add_request(prompts(1, seed=8)[0], SamplingParams(max_tokens=50, temperature=0))
    b = engine.add_request(prompts(1, seed=9)[0], SamplingParams(max_tokens=5, temperature=0))
    for _ in range(3):
        engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    engine.abort(a)
    outs = engine.step()
    assert any(o.request_id == a and o.finished and o.finish_reason == "abort" for o in outs)
    while engine.has_unfinished():
        engine.step()
    assert engine.completion(a).finish_reason == "abort"
    assert engine.completion(b).finish_reason == "length"
    engine.abort("no-such-request")  # ignored
    assert engine.stats()["kv_blocks_used"] == 0


def test_stop_token_ids_and_max_tokens(hf, prompts):
    p = prompts(1, seed=10)[0]
    free = _alone(hf, p, SamplingParams(max_tokens=10, temperature=0)).token_ids
    engine = Engine(hf, None, max_model_len=128)
    c = engine.generate([p], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(free[3],)))[0]
    cut = free.index(free[3]) + 1
    assert c.token_ids == free[:cut] and c.finish_reason == "stop"
    assert len(c.logprobs) == len(c.policy_versions) == cut


def test_stop_strings_cut_the_text():
    from opencomposer.models.registry import load_model

    hf, tok = load_model("tiny-random")
    engine = Engine(hf, tok, max_model_len=128)
    p = tok.encode("The list: one, two, three")
    free = engine.generate([p], SamplingParams(max_tokens=12, temperature=0))[0]
    assert free.finish_reason == "length" and free.text
    stop = free.text[len(free.text) // 2:][:3]
    c = engine.generate([p], SamplingParams(max_tokens=12, temperature=0, stop=(stop,)))[0]
    assert c.finish_reason == "stop"
    assert c.text == free.text[:free.text.find(stop)]
    assert len(c.token_ids) < len(free.token_ids)


def test_ignore_eos_generates_past_end_of_turn_tokens_to_max_tokens():
    """The model's EOS ends a sequence unless ``ignore_eos`` (vLLM's extension: benchmarks and
    tests that need a fixed length); an explicit stop token still ends it."""
    from opencomposer.models.registry import load_model

    hf, tok = load_model("tiny-random")
    p = tok.encode("The list: one, two, three")
    free = Engine(hf, tok, max_model_len=128).generate([p], SamplingParams(max_tokens=12, temperature=0))[0]
    eos = free.token_ids[3]
    hf.generation_config.eos_token_id = eos  # this model's turn now ends at the 4th token it writes
    engine = Engine(hf, tok, max_model_len=128)
    assert eos in engine.eos_ids
    cut = free.token_ids.index(eos) + 1
    ended = engine.generate([p], SamplingParams(max_tokens=12, temperature=0))[0]
    assert ended.token_ids == free.token_ids[:cut] and ended.finish_reason == "stop"
    assert ended.text == tok.decode(free.token_ids[:cut - 1])
    on = engine.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert on.token_ids == free.token_ids and on.finish_reason == "length" and on.text == free.text
    stopped = engine.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                  stop_token_ids=(eos,)))[0]
    assert stopped.token_ids == free.token_ids[:cut] and stopped.finish_reason == "stop"
    with pytest.raises(ValueError, match=r"ignore_eos='yes' \(True or False\)"):
        engine.add_request(p, SamplingParams(ignore_eos="yes"))
    assert engine.stats()["kv_blocks_used"] == 0


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(hf, prompts):
    ps = prompts(3, seed=11)
    engine = Engine(hf, None, max_model_len=128)
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=123)
    a = [c.token_ids for c in engine.generate(ps, sp)]
    b = [c.token_ids for c in engine.generate(ps[:1], sp)]  # other batch company, same seed
    assert a[0] == b[0]
    greedy = [c.token_ids for c in engine.generate(ps, GREEDY)]
    topk1 = [c.token_ids for c in engine.generate(ps, SamplingParams(max_tokens=10, temperature=0.9, top_k=1))]
    assert topk1 == greedy
    top_p = engine.generate(ps, SamplingParams(max_tokens=10, temperature=1.0, top_p=0.05, seed=1))
    assert [c.token_ids for c in top_p] == greedy  # 5% of mass: only the argmax survives here
    assert all(lp <= 0 for c in top_p for lp in c.logprobs)


def test_weight_update_in_flight(hf, tiny_hf, prompts):
    other = tiny_hf("qwen2", seed=1)
    engine = Engine(hf, None, max_model_len=128, block_size=4)
    p = prompts(1, lo=20, hi=21, seed=12)[0]
    rid = engine.add_request(p, SamplingParams(max_tokens=12, temperature=0))
    for _ in range(5):
        engine.step()  # prefill + 4 decode tokens with version 0
    engine.update_weights(other.state_dict(), version=1)
    assert engine.policy_version == 1
    while engine.has_unfinished():
        engine.step()
    c = engine.completion(rid)
    assert c.policy_versions == [0] * 5 + [1] * 7  # continued, not dropped; every token tagged
    # a new request after the update: no stale prefix K/V, same output as the new model alone
    c2 = engine.generate([p], SamplingParams(max_tokens=12, temperature=0))[0]
    assert c2.cached_prompt_tokens == 0
    assert c2.token_ids == _alone(other, p, SamplingParams(max_tokens=12, temperature=0)).token_ids
    assert c2.policy_versions == [1] * 12
    assert engine.stats()["kv_blocks_used"] == 0


def test_an_update_waits_for_at_most_the_step_running(hf, tiny_hf, prompts):
    """A thread stepping without pause cannot starve an in-flight update: the update takes
    the lock at the end of the step that holds it (a turnstile), not after many steps. Counted
    by the engine from the moment the update holds the turnstile: steps the stepping thread
    runs while the update is still on its way there (preparing tensors, or descheduled) are
    not waiting and are not counted."""
    import threading

    other = tiny_hf("qwen2", seed=1)
    engine = Engine(hf, None, max_model_len=128, max_num_seqs=4)
    for p in prompts(4, seed=3):
        engine.add_request(p, SamplingParams(max_tokens=80, temperature=1.0))
    steps, stop, started = [0], threading.Event(), threading.Event()

    def stepper():
        while not stop.is_set() and engine.has_unfinished():
            engine.step()
            steps[0] += 1
            started.set()
    t = threading.Thread(target=stepper)
    t.start()
    started.wait(30)
    waited = []
    for v in (1, 2, 3):
        before = engine.counts()["weight_update_wait_steps"]
        engine.update_weights((other if v % 2 else hf).state_dict(), version=v)
        waited.append(engine.counts()["weight_update_wait_steps"] - before)
    stop.set()
    t.join(30)
    assert engine.policy_version == 3 and steps[0] > 0 and max(waited) <= 1, waited


def test_bad_input_is_a_clear_error(hf):
    engine = Engine(hf, None, max_model_len=64, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 exceeds max_model_len=64"):
        engine.add_request([3] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match=r"token id 500 is outside the vocabulary \[0, 97\)"):
        engine.add_request([3, 500], GREEDY)
    with pytest.raises(ValueError, match=r"temperature=-1.*top_p=0"):
        engine.add_request([3], SamplingParams(temperature=-1, top_p=0))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(hf, None, max_model_len=10_000)
    with pytest.raises(ValueError, match="kv_blocks=2 cannot hold one sequence"):
        Engine(hf, None, max_model_len=64, kv_blocks=2)
    for fraction in (0, 1.5):
        with pytest.raises(ValueError, match=rf"kv_memory_fraction={fraction}: expected .* in \(0, 1\]"):
            Engine(hf, None, max_model_len=64, kv_memory_fraction=fraction)
    rid = engine.add_request([3, 4], GREEDY, request_id="x")
    with pytest.raises(ValueError, match="'x' is already in use"):
        engine.add_request([3, 4], GREEDY, request_id="x")
    engine.abort(rid)
    engine.step()
    assert engine.stats()["kv_blocks_used"] == 0


def test_update_weights_rejects_unknown_keys_and_shapes(hf):
    engine = Engine(hf, None, max_model_len=64)
    with pytest.raises(ValueError, match="'model.nope.weight' is not a parameter"):
        engine.update_weights({"model.nope.weight": torch.zeros(1)}, version=1)
    with pytest.raises(ValueError, match=r"shape \(3,\), expected \(64,\)"):
        engine.update_weights({"model.norm.weight": torch.zeros(3)}, version=1)
    assert engine.policy_version == 0


def test_the_cpu_kv_budget_is_an_eighth_of_available_memory_within_1_to_4_gib(tmp_path):
    from opencomposer.inference.engine.build import cpu_kv_bytes

    def budget(kib: int | None) -> int:
        f = tmp_path / "meminfo"
        f.write_text("MemTotal:       24000000 kB\n" + (f"MemAvailable:   {kib} kB\n" if kib is not None else ""))
        return cpu_kv_bytes(str(f))

    assert budget(16 * 2**20) == 2 << 30  # 16 GiB available -> 2 GiB
    assert budget(2 * 2**20) == 1 << 30 and budget(None) == 1 << 30 and cpu_kv_bytes(str(tmp_path / "no")) == 1 << 30
    assert budget(64 * 2**20) == 4 << 30


def test_step_time_is_split_into_wall_and_the_stepping_threads_cpu(hf, prompts, monkeypatch):
    import time

    engine = Engine(hf, None, max_model_len=128)
    engine.generate(prompts(2, seed=3), GREEDY)
    c = engine.counts()
    assert c["steps"] > 0 and 0 < c["step_cpu_seconds"] <= c["step_seconds"] + 1e-3
    # a step that waits (here in its scheduler, as it would for the device or the GIL) adds wall
    # time and next to no CPU time
    schedule = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: (time.sleep(0.2), schedule())[1])
    engine.add_request(prompts(1, seed=4)[0], GREEDY)
    engine.step()
    after = engine.counts()
    wall, cpu = after["step_seconds"] - c["step_seconds"], after["step_cpu_seconds"] - c["step_cpu_seconds"]
    assert wall >= 0.2 and wall - cpu >= 0.19
    # of the waiting, the time runnable without a core (Linux schedstat; 0 elsewhere): a sleep is not that
    rq = after["step_runqueue_seconds"] - c["step_runqueue_seconds"]
    assert 0 <= rq < 0.1
