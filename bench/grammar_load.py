"""Hostile grammars beside plain streams (issue 54): what compiling them costs everyone else.

`shardline serve` (the default model, its default paged export, `--max-streams 4`) in a
subprocess on a loopback port. Two plain clients stream completions in a closed loop (64 tokens,
stop tokens ignored, greedy); per request, the time to the first token, the median gap between
tokens and the whole request. Phases, interleaved round by round (`--rounds`, `--seconds` each):

- alone: the plain clients only;
- audit: four more clients send issue 54's audit schemas and grammars in a closed loop, each
  request's text never seen before (the cache cannot help): 8,000 integer properties (234 KiB),
  an anyOf of 3,000 objects, 20,000 GBNF alternatives, `"a"{1000000}`, the patterns
  `^a{1000000}$` and `^((a{100}){100}){100}$`, a required self-reference (the bodies encoded
  once, each request's number put in a title or a comment, so the client's own CPU stays small).
  Before issue 54, four of these at once took 57-62 s each and slowed plain requests 4x (the audit);
- flood: the control: the same bodies, sent for another model, so each is read, parsed and
  checked like the audit's and then refused (404) before any grammar is looked at: what four
  clients flooding the server with large JSON cost, grammars or not;
- at-caps: four clients send the costliest schemas that pass the caps (model/schema_caps.py),
  new each time: an anyOf of 1,000 objects of an optional property (the probe refuses it, after
  compiling it), an anyOf of 1,000 objects of a required one, 998 properties with two objects of
  400 optional ones, a 30-deep chain of 30-property objects; the ones that pass ask for more
  tokens than the context, so each is compiled in full and then refused, never decoded.

The plain requests' medians per phase, the ratios to `alone` (target: <= 1.2x, issue 54), and
what the hostile requests got (400s, or 404s for the flood; their median answer time).

    python bench/grammar_load.py                     # ~4 min on 2 cores
    python bench/grammar_load.py --rounds 1 --seconds 10
    PYTHONPATH=OLD/src python bench/grammar_load.py --phases audit   # an older tree's server

The last line on stdout is one JSON object with the figures, ratios first.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from typing import Any

import httpx2 as httpx
from kit import Proc, wait_quiet  # bench/ is on sys.path when this script runs

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PHASES = ("alone", "flood", "audit", "at-caps")


def _fmt(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


MARK = "QQQ"  # in every name of a hostile body: each request puts its own number there (bytes.replace)


def audit() -> list[tuple[str, dict[str, Any]]]:
    """The audit's triggers, as it sent them; MARK in a title or a comment makes each request's
    text new (nothing is cached)."""
    return [
        ("chat", _fmt({"title": MARK, "type": "object",
                       "properties": {f"p{i}": {"type": "integer"} for i in range(8000)}})),  # 234 KiB
        ("chat", _fmt({"title": MARK, "anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string"}},
                                                 "required": [f"k{i}"]} for i in range(3000)]})),
        ("completion", {"grammar": f"# {MARK}\nroot ::= " + " | ".join(f'"w{i}"' for i in range(20_000))}),
        ("completion", {"grammar": f'# {MARK}\nroot ::= "a"{{1000000}}'}),
        ("chat", _fmt({"title": MARK, "type": "string", "pattern": "^a{1000000}$"})),
        ("chat", _fmt({"title": MARK, "type": "string", "pattern": "^((a{100}){100}){100}$"})),
        ("chat", _fmt({"title": MARK, "type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]})),
    ]


def at_caps() -> list[tuple[str, dict[str, Any]]]:
    """The costliest schemas within the caps (MARK in a title: new each time), asking for more
    tokens than the context."""
    def obj(k: int, required: bool) -> dict[str, Any]:
        return {"type": "object", "properties": {f"k{k}": {"type": "string"}},
                **({"required": [f"k{k}"]} if required else {})}

    def chain() -> dict[str, Any]:
        d: dict[str, Any] = {"type": "integer"}
        for i in range(30):
            d = {"type": "object", "properties": {**{f"x{i}_{j}": {"type": "integer"} for j in range(30)}, "next": d}}
        return d

    wide = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {f"a{i}": {"type": "integer"} for i in range(400)}},
        "b": {"type": "object", "properties": {f"b{i}": {"type": "integer"} for i in range(400)}},
        **{f"c{i}": {"type": "integer"} for i in range(198)}}}
    kinds = [{"anyOf": [obj(k, False) for k in range(1000)]}, {"anyOf": [obj(k, True) for k in range(1000)]},
             wide, chain()]
    return [("chat", {**_fmt({"title": MARK, **k}), "max_tokens": 1_000_000}) for k in kinds]


def encoded(made: list[tuple[str, dict[str, Any]]], model: str = "m") -> list[tuple[str, bytes]]:
    """Each request's path and body, encoded once (the client's own CPU is not what is measured)."""
    out = []
    for endpoint, extra in made:
        base = {"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "hi"}
        path = "chat/completions" if endpoint == "chat" else "completions"
        out.append((path, json.dumps({"model": model, "max_tokens": 4, **base, **extra}).encode()))
    return out


async def plain(client: httpx.AsyncClient, url: str, until: float, out: list[dict[str, float]]) -> None:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "stream": True, "ignore_eos": True}
    while time.perf_counter() < until:
        start, stamps = time.perf_counter(), []
        async with client.stream("POST", f"{url}/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        out.append({"ttft": stamps[0] - start, "gap": statistics.median(gaps), "e2e": time.perf_counter() - start})


async def hostile(client: httpx.AsyncClient, url: str, until: float, bodies: list[tuple[str, bytes]],
                  seq: itertools.count[int], out: list[tuple[int, float]]) -> None:
    while time.perf_counter() < until:
        n = next(seq)
        path, body = bodies[n % len(bodies)]
        start = time.perf_counter()
        r = await client.post(f"{url}/{path}", content=body.replace(MARK.encode(), str(n).encode()),
                              headers={"content-type": "application/json"})
        out.append((r.status_code, time.perf_counter() - start))


async def phase(url: str, name: str, seconds: float, seq: itertools.count[int]) -> dict[str, Any]:
    plains: list[dict[str, float]] = []
    answers: list[tuple[int, float]] = []
    until = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=600) as client:
        jobs = [plain(client, url, until, plains) for _ in range(2)]
        if name != "alone":
            made = at_caps() if name == "at-caps" else audit()
            bodies = encoded(made, "another-model" if name == "flood" else "m")
            jobs += [hostile(client, url, until, bodies, seq, answers) for _ in range(4)]
        await asyncio.gather(*jobs)
    return {"plains": plains, "answers": answers}


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    plains = [p for r in runs for p in r["plains"]]
    answers = [a for r in runs for a in r["answers"]]
    row = {f"{k}_ms": 1000 * statistics.median(p[k] for p in plains) for k in ("ttft", "gap", "e2e")}
    row["plain_requests"] = len(plains)
    if answers:
        row["hostile_requests"] = len(answers)
        row["hostile_answer_ms"] = 1000 * statistics.median(t for _, t in answers)
        row["hostile_400"] = sum(s in (400, 404) for s, _ in answers)
        row["hostile_other"] = sum(s not in (400, 404) for s, _ in answers)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0, help="per phase per round")
    ap.add_argument("--no-wait", action="store_true", help="measure without waiting for a quiet machine")
    ap.add_argument("--phases", default=",".join(PHASES), help="of " + ", ".join(PHASES) + " (alone always)")
    args = ap.parse_args()
    phases = ("alone", *(p for p in args.phases.split(",") if p in PHASES[1:]))
    if not args.no_wait:
        wait_quiet()
    server = Proc(["serve", "--port", "0", "--model-id", "m", "--max-streams", "4"], "serving ", stream="stderr",
                  timeout_s=600)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in phases}
    seq = itertools.count()
    try:
        asyncio.run(phase(server.url, "alone", 5, seq))  # warm: the first requests, the grammar engine's vocabulary
        for r in range(args.rounds):
            for name in phases if r % 2 == 0 else phases[::-1]:
                runs[name].append(asyncio.run(phase(server.url, name, args.seconds, seq)))
    finally:
        server.stop()
    rows = {name: summary(runs[name]) for name in phases}
    print(f"{'phase':9s} {'ttft p50':>9s} {'gap p50':>8s} {'e2e p50':>8s} {'plain':>6s} {'hostile':>8s} "
          f"{'answer p50':>10s} {'400s':>5s} {'other':>5s}")
    for name, row in rows.items():
        print(f"{name:9s} {row['ttft_ms']:8.1f}ms {row['gap_ms']:6.1f}ms {row['e2e_ms']:7.0f}ms "
              f"{row['plain_requests']:6.0f} {row.get('hostile_requests', 0):8.0f} "
              f"{row.get('hostile_answer_ms', 0):8.1f}ms {row.get('hostile_400', 0):5.0f} "
              f"{row.get('hostile_other', 0):5.0f}")
    ratios = {f"{name}_{k}_ratio": round(rows[name][f"{k}_ms"] / rows["alone"][f"{k}_ms"], 3)
              for name in phases[1:] for k in ("e2e", "gap", "ttft")}
    print(json.dumps({**ratios, **{f"{name}_{k}": round(v, 2) for name, row in rows.items() for k, v in row.items()},
                      "rounds": args.rounds, "seconds": args.seconds}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
