"""``opencomposer serve`` through the official ``openai`` client: real engine, real HTTP.

The served model is tiny-random after a few seconds of training to answer one request
with one tool call (greedy), so the tool-call path runs end to end through the real
engine; other prompts get tiny-random's usual noise. uvicorn runs in a thread of this
process on a free port.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from testkit.live_server import serve_in_thread
import torch

from opencomposer.inference.server.app import ServeConfig, build_server

MODEL = "tiny-tool"
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
ASK = [{"role": "user", "content": "Read a.py"}]
CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
MAX_LEN = 1536


def train_tool_caller(out_dir) -> None:
    """tiny-random, fitted (teacher forcing, ~100 Adam steps on one example) to answer ASK
    with CALL and then <|im_end|>; saved as an HF model directory the server loads."""
    from opencomposer.inference.server.chat_format import render_chat
    from opencomposer.models import load_model
    from opencomposer.models.chat import encode_prompt

    model, tok = load_model("tiny-random")
    prompt = encode_prompt(tok, render_chat(tok, ASK, [READ_FILE]))
    target = tok(CALL + "<|im_end|>", add_special_tokens=False)["input_ids"]
    ids, y = torch.tensor([prompt + target[:-1]]), torch.tensor(target)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a busy machine
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(400):
            logits = model(ids, logits_to_keep=len(target)).logits[0]
            loss = torch.nn.functional.cross_entropy(logits, y)
            if loss.item() < 0.05:
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
    torch.set_num_threads(threads)
    assert loss.item() < 0.05, f"could not fit the tool call (loss {loss.item():.3f})"
    model.eval().save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


class Running:
    def __init__(self, cfg: ServeConfig):
        self.server = build_server(cfg)
        self.uv, self.thread, self.base = serve_in_thread(self.server)
        self.url = self.base + "/v1"

    def metrics(self) -> dict:
        return httpx.get(self.base + "/metrics", timeout=30).json()

    def wait_idle(self, timeout: float = 30) -> dict:
        """Metrics once nothing runs or waits in the engine and no slot is held."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            e = m["engine"]
            if (e["running"], e["waiting"], m["server"]["pending"]) == (0, 0, 0) or time.time() > deadline:
                return m
            time.sleep(0.1)

    def close(self) -> None:
        self.uv.should_exit = True
        self.thread.join(10)
        self.server.loop.stop()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-tool")
    train_tool_caller(model_dir)
    s = Running(ServeConfig(model=str(model_dir), served_model_name=MODEL, max_num_seqs=8, max_pending=32,
                            max_model_len=MAX_LEN, default_max_tokens=48))
    s.model_dir = model_dir
    yield s
    s.close()


@pytest.fixture
def client(srv):
    return openai.OpenAI(base_url=srv.url, api_key="sk-none", max_retries=0, timeout=60)


def no_leaks(srv) -> None:
    m = srv.wait_idle()
    assert m["engine"]["kv_blocks_used"] == 0, m
    assert (m["engine"]["running"], m["engine"]["waiting"], m["server"]["pending"]) == (0, 0, 0), m


# --------------------------------------------------------------------------- happy paths


def test_models_health_and_metrics(srv, client):
    [m] = client.models.list().data
    assert m.id == MODEL and m.model_extra["max_model_len"] == MAX_LEN
    assert httpx.get(srv.base + "/health").json()["status"] == "ok"
    met = srv.metrics()
    assert met["engine"]["kv_blocks_total"] > 0 and met["server"]["max_pending"] == 32


def test_tool_call_comes_back_as_message_tool_calls(srv, client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[READ_FILE], temperature=0,
                                       logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "read_file"
    assert json.loads(call.function.arguments) == {"path": "a.py"}
    assert call.id.startswith("call_")
    # logprobs of every sampled token (the stop token included), all finite and <= 0
    lps = choice.logprobs.content
    assert len(lps) == r.usage.completion_tokens
    assert "".join(t.token for t in lps[:-1]) == CALL and lps[-1].token == "<|im_end|>"
    assert all(-50 < t.logprob <= 0 for t in lps)
    # top_logprobs=2: greedy, so the first alternative is the sampled token itself
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in lps)
    assert all(abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6 and t.top_logprobs[1].logprob <= t.logprob
               for t in lps)
    no_leaks(srv)


def test_tool_call_streams_as_a_tool_calls_delta(srv, client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[READ_FILE], temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == ""  # no part of the <tool_call> tag leaks into the prose
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("read_file", {"path": "a.py"})]
    assert finishes == ["tool_calls"]
    n_call = len(srv.server.tokenizer(CALL + "<|im_end|>", add_special_tokens=False)["input_ids"])
    assert chunks[-1].usage.completion_tokens == n_call


def test_raw_sse_ends_with_done(srv):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", srv.url + "/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")


def test_harness_conversation_prompt_is_the_training_prompt(srv, client):
    """The server counts exactly the tokens of ``render_prompt`` for the harness's own messages."""
    from opencomposer.policies.openai import to_openai_messages
    from opencomposer.harness.tools import tool_schemas
    from opencomposer.models.chat import encode_prompt, render_prompt
    from opencomposer.protocols import Message, ToolCall

    msgs = [Message("system", "sys"), Message("user", "fix it"),
            Message("assistant", "", [ToolCall("read_file", {"path": "a.py"}, "c0")]),
            Message("tool", "x = 1\n", tool_call_id="c0")]
    tok = srv.server.tokenizer
    want = len(encode_prompt(tok, render_prompt(tok, msgs, tool_schemas())))
    r = client.chat.completions.create(model=MODEL, messages=to_openai_messages(msgs), tools=tool_schemas(),
                                       max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == want


def test_n_choices_and_seeded_sampling(srv, client):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 6,
          "temperature": 1.0, "seed": 7}
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # seeded
    assert len({c.message.content for c in a.choices}) > 1  # seed + i per choice: different samples
    assert a.usage.completion_tokens == 18
    no_leaks(srv)


def test_n_choices_compute_the_prompt_once(srv, client):
    """n > 1 submits n sequences of one prompt: its full blocks are computed once and the
    other sequences reuse them (the engine's count of prefilled tokens; usage counts the
    prompt once, as OpenAI's does)."""
    words = " ".join(f"w{i}" for i in range(60))  # not sent before: no earlier request caches it
    before = srv.wait_idle()["engine"]["prefill_tokens_computed"]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words}], n=4,
                                       max_tokens=2, temperature=1.0)
    prompt = r.usage.prompt_tokens
    tail = prompt - (prompt - 1) // 16 * 16  # what a sequence whose full blocks are cached computes
    computed = srv.wait_idle()["engine"]["prefill_tokens_computed"] - before
    assert prompt > 64 and computed <= prompt + 3 * tail < 2 * prompt
    no_leaks(srv)


def test_stream_equals_non_stream_and_stop_strings_are_cut(srv, client):
    kw = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0}
    full = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == full and len(full) > 10
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    cut_streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, stop=stop, **kw)
                           if c.choices)
    assert cut_streamed == cut.text


def test_completions_token_prompts_echo_and_logprobs(srv, client):
    tok = srv.server.tokenizer
    ids = tok("def add(a, b):", add_special_tokens=False)["input_ids"]
    r = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=4, temperature=0, logprobs=1, echo=True)
    assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text
    assert r.choices[0].text.startswith("def add(a, b):")
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and lp.text_offset[0] == len("def add(a, b):")
    # logprobs=1: the most likely token at each step, which greedy decoding sampled
    assert [list(d.items()) for d in lp.top_logprobs] == [[(t, v)] for t, v in zip(lp.tokens, lp.token_logprobs)]
    assert r.usage.prompt_tokens == 2 * len(ids)
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


# --------------------------------------------------------------------------- bad input


def test_prompt_longer_than_the_context_is_a_400_naming_the_lengths(srv, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * (MAX_LEN + 10), max_tokens=4)
    assert f"{MAX_LEN + 10} tokens" in str(e.value) and f"context of {MAX_LEN}" in str(e.value)
    assert e.value.code == "context_length_exceeded"  # what the harness reads as a full context
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 1600}])
    assert "leaves no room" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=MAX_LEN)
    assert f"max_tokens is {MAX_LEN}" in str(e.value)
    no_leaks(srv)


@pytest.mark.parametrize("extra, needle", [
    ({"n": 17}, "n: Input should be less than or equal to 16"),
    ({"n": 0}, "n: Input should be greater than or equal to 1"),
    ({"temperature": -1}, "temperature"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters.type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required", "tools": [READ_FILE]}, "tool_choice"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_requests_are_400_naming_the_field(client, extra, needle):
    kw = {"model": MODEL, "messages": ASK, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    assert needle in str(e.value)


def test_unknown_model_is_404_and_garbage_body_is_400(srv, client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=ASK)
    r = httpx.post(srv.url + "/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_disconnect_mid_stream_aborts_and_frees_kv_blocks(srv):
    before = srv.metrics()["server"]["aborted"]
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_LEN - 64, "temperature": 0, "stream": True,
            "ignore_eos": True}  # seconds of tokens: the answer cannot end before the server sees the client go
    with httpx.stream("POST", srv.url + "/completions", json=body, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: {")
            if got >= 3:
                break  # leaving the block closes the connection mid-stream
    m = srv.wait_idle()
    assert m["server"]["aborted"] == before + 1
    assert m["engine"]["kv_blocks_used"] == 0 and m["engine"]["running"] == 0


def test_ignore_eos_runs_a_completion_to_max_tokens(srv):
    """vLLM's extension field: the end-of-turn token does not end the answer (a fixed length for
    benchmarks); without it this prompt ends after about 200 tokens."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0}
    free = httpx.post(srv.url + "/completions", json=body, timeout=60).json()
    assert free["choices"][0]["finish_reason"] == "stop" and free["usage"]["completion_tokens"] < 400
    full = httpx.post(srv.url + "/completions", json={**body, "ignore_eos": True}, timeout=60).json()
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 400
    bad = httpx.post(srv.url + "/completions", json={**body, "ignore_eos": "sometimes"}, timeout=60)
    assert bad.status_code == 400 and "ignore_eos" in bad.text
    no_leaks(srv)


def test_disconnect_while_waiting_for_a_non_streamed_answer_aborts(srv):
    """The answer runs to max_tokens (ignore_eos: ~1,500 tokens, seconds on a CPU), so the server
    must notice the client that gave up after 0.3 s; without it the model's own end of turn (~200
    tokens, under 0.4 s on an idle machine) could come first (CI saw that once)."""
    before = srv.metrics()["server"]["aborted"]
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_LEN - 64, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    m = srv.wait_idle()
    assert m["server"]["aborted"] == before + 1
    assert m["engine"]["kv_blocks_used"] == 0


def test_an_engine_failure_fails_the_requests_but_not_the_loop():
    """Fault injection: the engine's step raises once. Live requests get EngineFailed, their
    slots and KV blocks are freed, and the next request is served normally."""
    import asyncio

    from opencomposer.inference.engine.core import Engine, SamplingParams
    from opencomposer.inference.engine.loop import EngineFailed, EngineLoop

    engine = Engine.from_name("tiny-random", max_num_seqs=4, max_model_len=256)
    loop = EngineLoop(engine, max_pending=8).start()
    real_step = engine.step

    def broken_step():
        engine.step = real_step
        raise RuntimeError("device lost")

    async def run(prompts):
        loop.reserve(len(prompts))
        got = []
        async for i, out in loop.submit([(p, SamplingParams(max_tokens=8, temperature=0)) for p in prompts]):
            got += out.new_token_ids
        return got

    try:
        engine.step = broken_step
        with pytest.raises(EngineFailed, match="device lost"):
            asyncio.run(run([[1, 2, 3], [4, 5, 6]]))
        deadline = time.time() + 10
        while loop.pending and time.time() < deadline:  # the engine thread finishes failing the other one
            time.sleep(0.01)
        assert loop.alive and loop.error == "RuntimeError: device lost" and loop.pending == 0
        assert loop.counters["failed"] == 2
        assert len(asyncio.run(run([[1, 2, 3]]))) == 8
        stats = asyncio.run(_call(loop, engine.stats))
        assert stats["kv_blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0
    finally:
        loop.stop()


async def _call(loop, fn):
    return await loop.call(fn)


def test_engine_settings_reach_the_engine_and_bad_ones_are_config_errors():
    from opencomposer.config import ConfigError

    server = build_server(ServeConfig(model="tiny-random", max_num_seqs=2, max_model_len=64,
                                      max_num_batched_tokens=48, kv_memory_fraction=0.5))
    try:
        assert server.loop.engine.scheduler.max_num_batched_tokens == 48
    finally:
        server.loop.stop()
    with pytest.raises(ConfigError, match=r"serve --model tiny-random: kv_blocks=1 cannot hold one sequence"):
        build_server(ServeConfig(model="tiny-random", max_model_len=64, kv_blocks=1))


def test_speculative_serving_answers_as_plain_serving(srv, client, tmp_path):
    """``serve --draft HEAD``: the same greedy answers (the tool call included), drafts verified."""
    from opencomposer.config import ConfigError
    from opencomposer.models import load_model
    from opencomposer.train.mtp import head_for

    head_for(load_model(str(srv.model_dir))[0]).save(tmp_path / "head")
    spec = Running(ServeConfig(model=str(srv.model_dir), served_model_name=MODEL, max_num_seqs=4, max_pending=8,
                               max_model_len=MAX_LEN, default_max_tokens=24, draft=str(tmp_path / "head"), num_draft=3))
    try:
        other = openai.OpenAI(base_url=spec.url, api_key="sk-none", max_retries=0, timeout=60)
        for kw in ({"messages": ASK, "tools": [READ_FILE]}, {"messages": [{"role": "user", "content": "Hello"}]}):
            a = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, **kw).choices[0]
            b = other.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, **kw).choices[0]
            assert (b.message.content, b.finish_reason) == (a.message.content, a.finish_reason)
            assert [t.function.model_dump() for t in b.message.tool_calls or []] == \
                [t.function.model_dump() for t in a.message.tool_calls or []]
        assert a.message.content  # the second prompt answered in text
        m = spec.metrics()["engine"]
        assert m["spec_steps"] > 0 and m["spec_num_draft"] == 3
        no_leaks(spec)
    finally:
        spec.close()
    with pytest.raises(ConfigError, match="--draft .*missing.*mtp.json: no such file"):
        build_server(ServeConfig(model=str(srv.model_dir), draft=str(tmp_path / "missing")))
