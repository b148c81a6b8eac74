"""The server under large inputs: resident memory before and after, and /health latency while
they are served (issue 20: 0.5 MB texts grew RSS from 324 MB to 3.4 GB and blocked the event
loop for ~1.3 s each).

Starts ``orthrus-real serve`` on a seeded model (``--size``; a tiny one by default), sends
``--requests`` large requests (``--text-kb`` of varied text each) with ``--concurrency`` in
flight, alternating ``/v1/embeddings`` with ``truncate_prompt_tokens: -1`` (vLLM's benchmark
client sends that: the whole text is tokenised, its last max_model_len tokens embedded) and
``/tokenize`` of a text just under the length the model could hold, while a poller times
``GET /health`` every 20 ms. Prints RSS before (after a warm-up) and after, its growth (target:
under 100 MB) and /health latency percentiles (target: p99 under 50 ms), beside /health on the
idle server in the same run (the baseline: on a shared machine the load of others shows there).

Run: python -m benchmarks.cluster.server_memory [--requests 200] [--text-kb 500] [--size tiny]
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import numpy as np

from benchmarks.common import model_dir, parser, percentile, python_module, rss_mb, serving


def text_of(n_chars: int, rng: random.Random) -> str:
    words = []
    size = 0
    while size < n_chars:
        w = f"w{rng.randrange(10**6)} lorem{rng.randrange(100)} "
        words.append(w)
        size += len(w)
    return "".join(words)[:n_chars]


async def run(url: str, args, pid: int) -> dict:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        limit = (await c.get("/v1/models")).json()["data"][0]["max_model_len"]
        probe = (await c.post("/tokenize", json={"prompt": "x" * 900_000})).json()["error"]["message"]
        max_chars = int(probe.split("(")[1].split()[0])  # "... hold (N characters at ..."
        big = [text_of(args.text_kb * 1000, rng) for _ in range(8)]
        fit = [text_of(max_chars - 10, rng) for _ in range(8)]

        def body(i):
            if i % 2 == 0:
                return "/v1/embeddings", {"input": big[i % 8] + str(i), "truncate_prompt_tokens": -1}
            return "/tokenize", {"prompt": fit[i % 8]}

        for i in range(4):  # warm-up: allocator pools, tokenizer caches
            r = await c.post(*body(i)[:1], json=body(i)[1])
            r.raise_for_status()
        before = rss_mb(pid)
        stop = asyncio.Event()

        async def poll(latencies: list[float]):
            async with httpx.AsyncClient(base_url=url, timeout=60) as h:
                while not stop.is_set():
                    t = time.perf_counter()
                    (await h.get("/health")).raise_for_status()
                    latencies.append(time.perf_counter() - t)
                    await asyncio.sleep(0.02)

        idle: list[float] = []  # the baseline: /health on the idle server, same machine, same run
        poller = asyncio.create_task(poll(idle))
        await asyncio.sleep(args.idle_s)
        stop.set()
        await poller
        stop.clear()
        latencies: list[float] = []

        sem = asyncio.Semaphore(args.concurrency)
        codes: dict[int, int] = {}

        async def one(i):
            async with sem:
                path, b = body(i)
                r = await c.post(path, json=b)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1

        poller = asyncio.create_task(poll(latencies))
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
        stop.set()
        await poller
        await asyncio.sleep(1.0)
        after = rss_mb(pid)
    lat, base = np.array(latencies) * 1000, np.array(idle) * 1000

    def pct(a):
        return {k: percentile(a, q, digits=1) for k, q in (("p50", 50), ("p99", 99), ("max", 100))}

    return {"requests": args.requests, "text_kb": args.text_kb, "max_model_len": limit,
            "tokenize_chars": max_chars - 10, "status_codes": codes, "wall_s": round(wall, 1),
            "rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1),
            "rss_growth_mb": round(after - before, 1), "health_polls": int(lat.size),
            "health_ms": pct(lat), "health_idle_ms": pct(base),
            "health_p99_vs_idle": round(percentile(lat, 99) / percentile(base, 99), 2)}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--text-kb", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--size", default="tiny", help="init-model size of the served model")
    ap.add_argument("--idle-s", type=float, default=10.0, help="seconds of /health on the idle "
                    "server first (the baseline on this machine's load)")
    args = ap.parse_args()
    from orthrus_real.cluster.replicas import free_port

    with model_dir(None, args.size) as model:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve = python_module("orthrus_real.cli", "serve", "--model", str(model), "--port",
                              str(port), "--log-level", "warning")
        with serving(serve, url, 300.0, 60.0) as proc:
            result = asyncio.run(run(url, args, proc.pid))
    print(json.dumps(result, indent=1))
    ok = result["rss_growth_mb"] < 100 and result["health_ms"]["p99"] < 50
    print(f"RSS {result['rss_before_mb']} -> {result['rss_after_mb']} MB "
          f"(growth {result['rss_growth_mb']} MB, target < 100); /health p99 "
          f"{result['health_ms']['p99']} ms (target < 50): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
