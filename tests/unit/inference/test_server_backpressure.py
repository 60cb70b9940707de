"""10,000 concurrent requests against ``opencomposer serve``: 200 or 429 + Retry-After, fast;
the server stays healthy and holds no KV blocks afterwards.

The server is a subprocess (``--port 0``) so that its 10,000 sockets and the client's
are counted against two processes' file limits. The client is plain asyncio streams
(one connection per request, all opened at once), cheaper than an HTTP library, so the
measurement is of the server.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from opencomposer.inference.server.process import serve_process

N = 10_000
MAX_PENDING = 64


@pytest.fixture
def server():
    with serve_process("--model", "tiny-random", "--port", "0", "--max-pending", str(MAX_PENDING),
                       "--max-num-seqs", "32") as ready:
        yield ready["serving"].removesuffix("/v1")


async def one(host: str, port: int, request: bytes) -> tuple[object, bool, float]:
    """(status or exception name, has Retry-After, seconds from sent to answered) of one
    request on its own connection."""
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 120)
        writer.write(request)
        await writer.drain()
        t0 = time.perf_counter()
        data = await asyncio.wait_for(reader.read(), 300)  # Connection: close -> read to EOF
        writer.close()
    except (TimeoutError, OSError) as e:
        return type(e).__name__, False, time.perf_counter() - t0
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    return int(head.split(b" ", 2)[1]), b"\r\nretry-after: " in head, time.perf_counter() - t0


async def flood(base: str) -> list[tuple[object, bool, float]]:
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny-random", "prompt": "hi", "max_tokens": 2, "temperature": 0}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    return await asyncio.gather(*(one(host, int(port), request) for _ in range(N)))


@pytest.mark.slow
def test_ten_thousand_concurrent_requests_get_200_or_429_and_nothing_leaks(server):
    t0 = time.perf_counter()
    results = asyncio.run(flood(server))
    wall = time.perf_counter() - t0
    statuses = [s for s, _, _ in results]
    ok, busy = statuses.count(200), statuses.count(429)
    other = {s: statuses.count(s) for s in set(statuses) - {200, 429}}
    busy_s = sorted(t for s, _, t in results if s == 429)
    print(f"\n{N} requests in {wall:.1f}s: 200={ok} 429={busy} other={other}; "
          f"429 latency p50={busy_s[len(busy_s) // 2]:.2f}s p99={busy_s[int(len(busy_s) * 0.99)]:.2f}s"
          if busy_s else f"\n{N} requests: 200={ok} 429={busy} other={other}")
    assert other == {}, other  # no connection errors, no 5xx
    assert ok + busy == N and ok >= MAX_PENDING and busy > 0
    assert all(retry for s, retry, _ in results if s == 429)
    # healthy afterwards, nothing held, and still serving
    m = httpx.get(server + "/metrics", timeout=60).json()
    assert m["server"]["pending"] == 0 and m["engine"]["kv_blocks_used"] == 0
    assert m["engine"]["running"] == m["engine"]["waiting"] == 0
    assert m["server"]["rejected"] == busy and m["server"]["finished"] == ok
    assert httpx.get(server + "/health", timeout=30).json()["status"] == "ok"
    r = httpx.post(server + "/v1/completions", json={"model": "tiny-random", "prompt": "hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
