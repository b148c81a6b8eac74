"""``orthrus-real bench``: drive a live server with a scenario's ``workload`` section and write
``results.json`` in the simulator's schema (``orthrus.results/1``).

Generation requests stream (``stream: true``, ``ignore_eos: true`` so outputs have the sampled
length) to measure time to first token; prompts and inputs are token arrays of the sampled
lengths. For Iter-RetGen workflows, retrieval is real: a generated corpus is embedded through
the server before the clock starts, and each iteration's query embedding is searched with numpy
cosine top-k; retrieval time is reported separately (``retrieval_s``).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import numpy as np

from orthrus_sim.engine.request import Request, RequestKind, RequestState
from orthrus_sim.scenario import Scenario
from orthrus_sim.sim.metrics import request_metrics, summary
from orthrus_sim.sim.workload import (
    EMB,
    GEN,
    Phases,
    Workflow,
    interarrival,
    load_trace,
    sample_synthetic,
)

SCHEMA = "orthrus.results/1"


class Rejected(Exception):
    """The server (or engine) refused a request; the message is its reason."""


class HttpTransport:
    """Requests over the OpenAI-compatible HTTP API of a running server."""

    def __init__(self, client: httpx.AsyncClient, model: str) -> None:
        self.client, self.model = client, model

    @staticmethod
    def _reason(response: httpx.Response) -> str:
        try:
            reason = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            reason = response.text[:200]
        return f"HTTP {response.status_code}: {reason}"

    async def embed(self, batch: list[list[int]]) -> list[list[float]]:
        r = await self.client.post("/v1/embeddings", json={"model": self.model, "input": batch})
        if r.status_code != 200:
            raise Rejected(self._reason(r))
        return [d["embedding"] for d in r.json()["data"]]

    async def generate(self, ids: list[int], n_out: int, on_token) -> None:
        body = {"model": self.model, "prompt": ids, "max_tokens": n_out, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                raise Rejected(self._reason(r))
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    on_token()


class EngineTransport:
    """Requests straight into an in-process engine thread (no HTTP): what the simulator models."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self._ids = 0

    async def _submit(self, kind: str, kwargs: dict):
        from orthrus_real.engine_thread import asyncio_sink

        self._ids += 1
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        rid = f"{kind[0]}{self._ids}"
        try:
            self.runner.submit(kind, rid, kwargs, asyncio_sink(loop, q))
        except RuntimeError as exc:
            raise Rejected(str(exc)) from None
        return rid, q

    async def _next(self, rid: str, q: asyncio.Queue):
        try:
            item = await q.get()
        except asyncio.CancelledError:
            self.runner.abort(rid)
            raise
        if isinstance(item, Exception):
            raise Rejected(str(item))
        return item

    async def embed(self, batch: list[list[int]]) -> list[list[float]]:
        out = []
        for ids in batch:
            rid, q = await self._submit("embedding", {"token_ids": ids})
            out.append((await self._next(rid, q)).embedding)
        return out

    async def generate(self, ids: list[int], n_out: int, on_token) -> None:
        from orthrus_real.sampling import SamplingParams

        rid, q = await self._submit("generation", {"token_ids": ids, "params": SamplingParams(
            max_tokens=n_out, temperature=0, ignore_eos=True)})
        while True:
            item = await self._next(rid, q)
            on_token()
            if item.finished:
                return


class LiveDriver:
    def __init__(self, transport, scenario: Scenario, token_range: int) -> None:
        self.transport = transport
        self.scenario = scenario
        self.workload = scenario.workload
        self.token_range = token_range
        self.phases = Phases(self.workload)
        self.issued: list[Request] = []
        self.workflows: list[Workflow] = []
        self.retrieval_s: list[float] = []
        self.units = 0
        self.t0 = time.monotonic()
        self.index: np.ndarray | None = None
        self.corpus: list[list[int]] = []
        self._ids = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def may_start(self) -> bool:
        s = self.scenario
        if s.duration_s is not None and self.now() >= s.duration_s:
            return False
        if s.num_requests is not None and self.units >= s.num_requests:
            return False
        return not self.phases.exhausted(self.units)

    def tokens(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(t) for t in rng.integers(4, self.token_range, size=n)]

    def _request(self, kind: RequestKind, n_in: int, n_out: int) -> Request:
        self._ids += 1
        req = Request(f"{'e' if kind is EMB else 'g'}{self._ids}", kind, self.now(), n_in,
                      max_output_tokens=n_out if kind is GEN else 0)
        self.issued.append(req)
        return req

    async def embed(self, ids: list[int]) -> tuple[Request, list[float] | None]:
        req = self._request(EMB, len(ids), 0)
        try:
            (vector,) = await self.transport.embed([ids])
        except Rejected as exc:
            req.reject(str(exc))
            return req, None
        req.transition(RequestState.RUNNING)
        req.transition(RequestState.FINISHED)
        req.finished_at = self.now()
        return req, vector

    async def generate(self, ids: list[int], n_out: int) -> Request:
        req = self._request(GEN, len(ids), n_out)

        def on_token() -> None:
            if req.state is RequestState.WAITING:
                req.transition(RequestState.RUNNING)
                req.first_token_at = self.now()
            req.num_generated += 1

        try:
            await self.transport.generate(ids, n_out, on_token)
        except Rejected as exc:
            req.reject(str(exc))
            return req
        if req.state is RequestState.WAITING:
            req.transition(RequestState.RUNNING)
        req.transition(RequestState.FINISHED)
        req.finished_at = self.now()
        return req

    # ----- units of work -------------------------------------------------------------------
    async def synthetic(self, rng: np.random.Generator) -> None:
        share = self.phases.generation_share(self.now(), self.units)
        kind, n_in, n_out = sample_synthetic(self.workload, rng, share)
        if kind is GEN:
            await self.generate(self.tokens(rng, n_in), n_out)
        else:
            await self.embed(self.tokens(rng, n_in))

    async def build_index(self, rng: np.random.Generator, size: int) -> None:
        cfg = self.workload.iter_retgen
        self.corpus = [self.tokens(rng, cfg.doc_tokens.sample(rng)) for _ in range(size)]
        vectors = []
        for lo in range(0, size, 32):
            vectors += await self.transport.embed(self.corpus[lo:lo + 32])
        m = np.asarray(vectors, dtype=np.float32)
        self.index = m / np.linalg.norm(m, axis=1, keepdims=True)

    def retrieve(self, query: list[float], k: int) -> list[int]:
        start = time.perf_counter()
        q = np.asarray(query, dtype=np.float32)
        scores = self.index @ (q / np.linalg.norm(q))
        top = np.argsort(-scores)[:k]
        docs = [t for i in top for t in self.corpus[i]]
        self.retrieval_s.append(time.perf_counter() - start)
        return docs

    async def workflow(self, rng: np.random.Generator) -> None:
        cfg = self.workload.iter_retgen
        flow = Workflow(len(self.workflows), self.now())
        self.workflows.append(flow)
        question = self.tokens(rng, cfg.question_tokens.sample(rng))
        answer: list[int] = []
        for _ in range(cfg.iterations):
            emb, vec = await self.embed(question + answer)
            if vec is None:
                return
            docs = self.retrieve(vec, cfg.docs_per_query.sample(rng))
            prompt = docs + question
            if cfg.max_prompt_tokens:
                prompt = prompt[-cfg.max_prompt_tokens:]
            gen = await self.generate(prompt, cfg.output_tokens.sample(rng))
            if gen.state is not RequestState.FINISHED:
                return
            answer = self.tokens(rng, gen.num_generated)
            flow.iterations_done += 1
        flow.end = self.now()

    async def one(self, rng: np.random.Generator) -> None:
        if self.workload.kind == "iter-retgen":
            await self.workflow(rng)
        else:
            await self.synthetic(rng)

    # ----- arrival processes ---------------------------------------------------------------
    async def prepare(self) -> None:
        """Work before the clock starts: the retrieval index of an Iter-RetGen workload."""
        if self.workload.kind == "iter-retgen":
            await self.build_index(np.random.default_rng([self.scenario.seed, 9]), 256)

    async def run(self) -> float:
        w, a, seed = self.workload, self.workload.arrival, self.scenario.seed
        self.t0 = time.monotonic()
        tasks: list[asyncio.Task] = []
        if w.kind == "trace":
            tasks.append(asyncio.create_task(self._replay(load_trace(w.trace), tasks)))
        elif a.process == "closed-loop":
            tasks += [asyncio.create_task(self._client(np.random.default_rng([seed, 1, c])))
                      for c in range(a.clients)]
        elif a.process == "burst":
            rng = np.random.default_rng([seed, 2])
            if w.kind == "iter-retgen":
                for i in range(self.scenario.num_requests or a.clients):
                    self.units += 1
                    tasks.append(asyncio.create_task(self.one(np.random.default_rng([seed, 4, i]))))
            else:
                for group in w.burst:
                    for _ in range(group.count):
                        self.units += 1
                        kind = GEN if group.kind == "generation" else EMB
                        if kind is GEN:
                            coro = self.generate(self.tokens(rng, w.generation_prompt.sample(rng)),
                                                 w.generation_output.sample(rng))
                        else:
                            coro = self.embed(self.tokens(rng, w.embedding_input.sample(rng)))
                        tasks.append(asyncio.create_task(coro))
        else:
            tasks.append(asyncio.create_task(self._open_loop(np.random.default_rng([seed, 3]), tasks)))
        if self.scenario.duration_s is not None:
            await asyncio.sleep(max(0.0, self.scenario.duration_s - self.now()))
            end = self.scenario.duration_s
            for t in tasks:
                t.cancel()  # what is still in flight is reported unfinished
        else:
            while not all(t.done() for t in tasks):
                await asyncio.gather(*[t for t in tasks if not t.done()], return_exceptions=True)
            end = self.now()
        await asyncio.gather(*tasks, return_exceptions=True)
        return end

    async def _client(self, rng: np.random.Generator) -> None:
        think = self.workload.arrival.think_time_s
        while self.may_start():
            self.units += 1
            await self.one(rng)
            if think:
                await asyncio.sleep(rng.exponential(think))

    async def _open_loop(self, rng: np.random.Generator, tasks: list) -> None:
        while True:
            await asyncio.sleep(interarrival(self.workload.arrival, rng))
            if not self.may_start():
                return
            self.units += 1
            tasks.append(asyncio.create_task(
                self.one(np.random.default_rng([self.scenario.seed, 4, self.units]))))

    async def _replay(self, rows: list[dict], tasks: list) -> None:
        rng = np.random.default_rng([self.scenario.seed, 5])
        for row in rows:
            delay = row["arrival_time"] - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            if not self.may_start():
                return
            self.units += 1
            ids = self.tokens(rng, row["input_tokens"])
            coro = (self.generate(ids, row["output_tokens"]) if row["kind"] == "generation"
                    else self.embed(ids))
            tasks.append(asyncio.create_task(coro))


def _prometheus(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) ([0-9.eE+-]+|NaN)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


async def measure(transport, scenario: Scenario, label: str, token_range: int, scrape) -> dict:
    """Drive ``transport`` with the scenario's workload; ``scrape()`` returns the engine's
    Prometheus text (for utilisation and budget fill)."""
    driver = LiveDriver(transport, scenario, token_range)
    await driver.prepare()
    before = _prometheus(await scrape())
    wall = time.perf_counter()
    end = await driver.run()
    wall = time.perf_counter() - wall
    await asyncio.sleep(0.3)  # let the engine notice cancelled requests
    after = _prometheus(await scrape())

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    start = min(scenario.warmup_s, end)
    metrics = request_metrics(driver.issued, driver.workflows, start, end)
    busy_s = delta("orthrus_iteration_seconds_sum")
    iterations = delta("orthrus_iteration_seconds_count")
    metrics.update({
        "utilization": {"busy": busy_s / max(end, 1e-12), "compute": None,
                        "per_gpu": [{"replica": 0, "role": "unified", "busy": busy_s / max(end, 1e-12),
                                     "iterations": iterations}]},
        "budget_fill": delta("orthrus_budget_fill_sum") / max(delta("orthrus_budget_fill_count"), 1),
        "iterations": int(iterations),
        "preemptions": None,
        "retrieval_s": summary(driver.retrieval_s) if driver.retrieval_s else None,
        "sim_end_s": end,
        "wall_s": wall,
    })
    return {"schema": SCHEMA, "scenario": scenario.model_dump(mode="json", by_alias=True),
            "runs": [{"configuration": label, "metrics": metrics}]}


async def bench(url: str, scenario: Scenario, label: str = "measured", token_range: int = 500,
                max_connections: int = 1024) -> dict:
    """Load a live server over HTTP."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(3600.0), limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def scrape() -> str:
            return (await client.get("/metrics")).text

        return await measure(HttpTransport(client, model), scenario, label, token_range, scrape)


async def bench_in_process(runner, metrics, scenario: Scenario, label: str = "measured",
                           token_range: int = 500) -> dict:
    """Load an engine thread in this process (no HTTP)."""
    from prometheus_client import generate_latest

    async def scrape() -> str:
        return generate_latest(metrics.registry).decode()

    return await measure(EngineTransport(runner), scenario, label, token_range, scrape)


def write_results(doc: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path
