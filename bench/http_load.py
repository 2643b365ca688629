"""Open-loop HTTP load against a shardline server (not a benchmark): Poisson arrivals of streamed
completions; TTFT, time per output token and end-to-end percentiles, the client's own lag and CPU.
bench/ is on sys.path when a script runs, so `from http_load import load`."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import httpx2 as httpx

# A prompt whose answer runs long (a story): streams keep decoding for the whole load.
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else float("nan")


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, object],
                      scheduled: float, t0: float) -> dict[str, float]:
    lag = time.perf_counter() - (t0 + scheduled)
    start = time.perf_counter()
    stamps: list[float] = []
    cpu = 0.0
    async with client.stream("POST", url, json=body) as r:
        async for line in r.aiter_lines():
            c0 = time.thread_time()
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
            cpu += time.thread_time() - c0
    end = time.perf_counter()
    return {"ttft": stamps[0] - start if stamps else float("nan"), "e2e": end - start, "tokens": len(stamps),
            "tpot": (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan"),
            "lag": lag, "client_cpu": cpu}


async def load(url: str, model: str, rate: float, count: int, tokens: int, seed: int,
               prompt: str = PROMPT) -> dict[str, float]:
    """`count` streamed completions of `tokens` tokens arriving at `rate` per second (seeded)."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        offsets.append(t)
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=300) as client:
        t0 = time.perf_counter()

        async def fire(off: float) -> dict[str, float]:
            await asyncio.sleep(max(0.0, t0 + off - time.perf_counter()))
            return await one_request(client, url, body, off, t0)

        results = await asyncio.wait_for(asyncio.gather(*(fire(o) for o in offsets)), timeout=900)
        wall = time.perf_counter() - t0
    tokens_out = sum(r["tokens"] for r in results)
    row: dict[str, float] = {"rate": rate, "requests": count, "throughput_tok_s": tokens_out / wall}
    for key in ("ttft", "tpot", "e2e"):
        for p in (50, 90, 99):
            row[f"{key}_p{p}_ms"] = 1000 * pct([r[key] for r in results], p)
    row["client_lag_p99_ms"] = 1000 * pct([r["lag"] for r in results], 99)
    row["client_cpu_per_req_ms"] = 1000 * statistics.mean(r["client_cpu"] for r in results)
    return row
