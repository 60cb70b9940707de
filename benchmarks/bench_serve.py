"""Cost of the HTTP layer: the same greedy requests through ``opencomposer serve`` and
straight into the engine, on the same engine instance.

    .venv/bin/python benchmarks/bench_serve.py --model smollm2-135m --requests 16 --max-tokens 32

The server runs in this process (uvicorn in a thread, port 0); ``--requests`` chat
requests go at once through the official ``openai`` async client, streamed, so each
one's time to first token is measured too. Then the same token prompts run through
``Engine.generate`` on the engine thread. Reports tokens/s both ways, their ratio, and
TTFT/latency p50/p90, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


async def through_http(url: str, model: str, prompts: list[str], max_tokens: int) -> tuple[float, list, list, int]:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)

    async def one(text: str) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        first, n = None, 0
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - t0
            if chunk.usage:
                n = chunk.usage.completion_tokens
        return first or 0.0, time.perf_counter() - t0, n

    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    return wall, [r[0] for r in res], [r[1] for r in res], sum(r[2] for r in res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="alternating HTTP/engine rounds; medians reported")
    args = ap.parse_args()

    from opencomposer.inference.server.chat_format import render_chat
    from opencomposer.inference.engine.core import SamplingParams
    from opencomposer.inference.server.app import ServeConfig, build_server, uvicorn_server
    from opencomposer.models.chat import encode_prompt

    srv = build_server(ServeConfig(model=args.model, max_num_seqs=max(args.requests, 1)))
    uv = uvicorn_server(srv, "127.0.0.1", 0)
    threading.Thread(target=uv.run, daemon=True).start()
    while not uv.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}/v1"
    prompts = [f"Write a Python function number {i} that adds two numbers." for i in range(args.requests)]

    asyncio.run(through_http(url, args.model, prompts[:2], 4))  # warm-up
    tok, engine = srv.tokenizer, srv.loop.engine
    ids = [encode_prompt(tok, render_chat(tok, [{"role": "user", "content": p}], [])) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)

    async def direct() -> tuple[float, int]:
        t0 = time.perf_counter()
        done = await srv.loop.call(lambda: engine.generate(ids, params), timeout=600)
        return time.perf_counter() - t0, sum(len(c.token_ids) for c in done)

    # Alternate the two, so load changes on a shared machine hit both alike; the prefix
    # cache is warm for both after the warm-up (same prompts every round).
    http_rates, engine_rates, ttft, latency = [], [], [], []
    asyncio.run(direct())
    for _ in range(args.rounds):
        wall, first, lat, n = asyncio.run(through_http(url, args.model, prompts, args.max_tokens))
        http_rates.append(n / wall)
        ttft += first
        latency += lat
        wall, n = asyncio.run(direct())
        engine_rates.append(n / wall)
    uv.should_exit = True
    srv.loop.stop()

    http_rate, engine_rate = pct(http_rates, 0.5), pct(engine_rates, 0.5)
    result = {
        "model": args.model, "requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "http_tokens_per_s": round(http_rate, 1), "engine_tokens_per_s": round(engine_rate, 1),
        "http_over_engine": round(http_rate / engine_rate, 3),
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9),
        "latency_p50_s": pct(latency, 0.5), "latency_p90_s": pct(latency, 0.9),
        "loadavg": os.getloadavg()[0],
    }
    print(f"HTTP {result['http_tokens_per_s']} tok/s vs engine {result['engine_tokens_per_s']} tok/s "
          f"({result['http_over_engine']:.0%}); TTFT p50 {result['ttft_p50_s']}s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
