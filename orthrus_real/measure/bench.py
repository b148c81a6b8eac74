"""``orthrus-real bench``: drive a live server (or an engine thread) with a scenario's workload and
write ``results.json`` in the simulator's schema, with the per-request CSV and the plots.

The requests are the scenario's, exactly: the workload generator (``orthrus_sim.experiment
.workload``) decides every request (ids, kinds, lengths, token ids, send times) from the seed, and
the workload's ``interpret`` carries its actions out with this module's driver as its asyncio
host, as it does with the simulator's SimPy driver.
Generation requests stream (``stream: true``, ``ignore_eos: true``, so outputs have the sampled
length) to measure time to first token. Utilisation, budget fill, iterations, preemptions and
admission waits come from the server's ``/metrics``.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import numpy as np

from orthrus_sim import safe_name
from orthrus_sim.engine.request import Request, RequestKind, RequestState
from orthrus_sim.experiment.quantiles import Quantiles, summarize, summary
from orthrus_sim.experiment.results import (
    MeasurementWindow,
    RequestLog,
    results_doc,
    window_warnings,
    write_csv,
    write_json,
)
from orthrus_sim.experiment.scenario import Scenario, scenario_dump
from orthrus_sim.experiment.workload import (
    Client,
    Outcome,
    RequestSpec,
    Retrieve,
    Send,
    Workload,
    interpret,
    run_async,
)


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
        from orthrus_real.server.engine_thread import asyncio_sink

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
        from orthrus_real.engine.sampling import SamplingParams

        rid, q = await self._submit("generation", {"token_ids": ids, "params": SamplingParams(
            max_tokens=n_out, temperature=0, ignore_eos=True)})
        while True:
            item = await self._next(rid, q)
            on_token()
            if item.finished:
                return


class LiveDriver:
    """Carries out the workload's actions in real time against a transport."""

    def __init__(self, transport, scenario: Scenario, token_range: int = 500,
                 keep_specs: bool = False) -> None:
        self.transport = transport
        self.scenario = scenario
        self.token_range = token_range
        self.t0 = time.monotonic()
        self.workload = Workload(scenario, self.now, keep_specs)
        self.log = RequestLog(scenario.warmup_s, end_hint=scenario.duration_s, seed=scenario.seed,
                              slo=scenario.slo)
        self.retrieval_s: list[float] = []
        self.itl = Quantiles()  # seconds between two tokens of one stream (after the warm-up)
        self.window_tokens = 0  # output tokens received after the warm-up
        self.index: np.ndarray | None = None
        self._tasks: list[asyncio.Task] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    @property
    def workflows(self):
        return self.workload.workflows

    # ----- one request ----------------------------------------------------------------------
    async def send(self, spec: RequestSpec) -> Outcome:
        req = Request(spec.request_id, spec.kind, self.now(), spec.input_len,
                      max_output_tokens=spec.max_output_tokens)
        self.log.sent(req, spec.phase)
        ids = spec.tokens.ids(self.token_range)
        try:
            if spec.kind is RequestKind.EMBEDDING:
                (vector,) = await self.transport.embed([ids])
            else:
                vector = None
                last = [None]

                def on_token() -> None:
                    now = self.now()
                    if req.state is RequestState.WAITING:
                        req.transition(RequestState.RUNNING)
                        req.first_token_at = now
                    req.num_generated += 1
                    if now >= self.scenario.warmup_s:
                        self.window_tokens += 1
                        if last[0] is not None:
                            self.itl.add(now - last[0])
                    last[0] = now

                await self.transport.generate(ids, spec.max_output_tokens, on_token)
        except Rejected as exc:
            if req.state is RequestState.WAITING:
                req.reject(str(exc))
                req.finished_at = self.now()
                self.log.ended(req)
                return Outcome("rejected", reason=str(exc))
            raise
        if req.state is RequestState.WAITING:
            req.transition(RequestState.RUNNING)
        req.transition(RequestState.FINISHED)
        req.finished_at = self.now()
        self.log.ended(req)
        return Outcome("finished", req.num_generated, embedding=vector)

    # ----- retrieval (workload.iter_retgen.retrieval: vector) --------------------------------
    async def prepare(self) -> None:
        """Work before the clock starts: embed the retrieval corpus for vector search."""
        w = self.scenario.workload
        uses_vectors = w.kind == "iter-retgen" and w.iter_retgen.retrieval == "vector"
        if not uses_vectors:
            return
        corpus = [doc.ids(self.token_range) for doc in self.workload.corpus()]
        vectors = []
        for lo in range(0, len(corpus), 32):
            vectors += await self.transport.embed(corpus[lo:lo + 32])
        m = np.asarray(vectors, dtype=np.float32)
        self.index = m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12)

    def retrieve(self, action: Retrieve) -> list[int]:
        if self.index is None or action.query is None:
            return list(action.fallback)
        start = time.perf_counter()
        q = np.asarray(action.query, dtype=np.float32)
        scores = self.index @ (q / max(float(np.linalg.norm(q)), 1e-12))
        top = [int(i) for i in np.argsort(-scores)[:action.k]]
        self.retrieval_s.append(time.perf_counter() - start)
        return top

    # ----- the host of ``interpret``: asyncio awaitables ------------------------------------
    def issue(self, send: Send):
        if send.wait:
            return self.send(send.spec)
        self._tasks.append(asyncio.create_task(self.send(send.spec)))
        return None

    def sleep(self, seconds: float):
        return asyncio.sleep(seconds)

    def spawn(self, client: Client) -> None:
        self._tasks.append(asyncio.create_task(run_async(interpret(client, self))))

    async def run(self, on_progress: Callable[[float], None] | None = None) -> float:
        """Run the workload; returns the end of the window (s). With ``duration_s``, what is
        still in flight at the end is cancelled and reported unfinished."""
        self.t0 = time.monotonic()
        for _, client in self.workload.clients():
            self.spawn(client)
        duration = self.scenario.duration_s
        if duration is not None:
            while self.now() < duration:
                await asyncio.sleep(min(0.25, max(0.0, duration - self.now())))
                if on_progress:
                    on_progress(min(1.0, self.now() / duration))
            end = duration
            for t in self._tasks:
                t.cancel()
        else:
            while not all(t.done() for t in self._tasks):
                await asyncio.gather(*[t for t in self._tasks if not t.done()],
                                     return_exceptions=True)
            end = self.now()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError):
                raise r
        return end


# ----- the engine's /metrics ------------------------------------------------------------------
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$")


def parse_prometheus(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def histogram_summary(before: dict, after: dict, name: str, labels: str) -> dict:
    """Mean and p50/p95/p99 of a Prometheus histogram's observations between two scrapes,
    the percentiles interpolated inside buckets (as ``histogram_quantile`` does)."""
    buckets = []
    prefix = f"{name}_bucket{{"
    for key, value in after.items():
        if key.startswith(prefix) and labels in key:
            le = re.search(r'le="([^"]+)"', key).group(1)
            buckets.append((float("inf") if le == "+Inf" else float(le), value - before.get(key, 0.0)))
    buckets.sort()
    count = buckets[-1][1] if buckets else 0.0
    if count <= 0:
        return summarize(0, None, lambda q: None)
    total = after.get(f"{name}_sum{{{labels}}}", 0.0) - before.get(f"{name}_sum{{{labels}}}", 0.0)

    def percentile(q: float) -> float:
        rank, lo, seen = q / 100 * count, 0.0, 0.0
        for le, cum in buckets:
            if cum >= rank:
                if le == float("inf"):
                    return lo
                inside = cum - seen
                return lo + (le - lo) * ((rank - seen) / inside if inside else 1.0)
            lo, seen = le, cum
        return lo

    return summarize(int(count), total / count, percentile)


VLLM_STEPS = "vllm:iteration_tokens_total_count"  # vLLM observes it once per engine step


def engine_steps(before: dict, after: dict) -> int:
    """Forward passes over a window: an Orthrus engine's ``orthrus_iterations_total``, or, for
    a server that has none (stock vLLM), the count of vLLM's tokens-per-step histogram, summed
    over its engines (its own record of how many steps it ran; 0 if neither is exposed)."""
    if "orthrus_iterations_total" in after:
        return int(after["orthrus_iterations_total"] - before.get("orthrus_iterations_total", 0.0))
    keys = [k for k in after if k.partition("{")[0] == VLLM_STEPS]
    return int(sum(after[k] - before.get(k, 0.0) for k in keys))


def engine_metrics(before: dict, after: dict, window_s: float, peak_flops: float | None) -> dict:
    """Utilisation, budget fill, iterations, preemptions and admission waits over a window;
    a cluster's (samples labelled ``replica``: ``orthrus-real serve --replicas``) summed over
    its replicas, with each replica's busy fraction and MFU in ``per_gpu`` (busy and MFU: the
    replicas' mean, as the simulator reports them)."""
    from orthrus_real.cluster.metrics_text import replica_roles, sum_replicas

    roles = replica_roles(after)
    before, before_each = sum_replicas(before)
    after, after_each = sum_replicas(after)

    def delta(key: str, a: dict = after, b: dict = before) -> float:
        return a.get(key, 0.0) - b.get(key, 0.0)

    span = max(window_s, 1e-12)
    per_gpu = []
    for i, a in sorted(after_each.items()):
        b = before_each.get(i, {})
        flops = delta("orthrus_model_flops_total", a, b)
        per_gpu.append({"replica": i, "role": roles.get(i, "unified"),
                        "busy": delta("orthrus_busy_seconds_total", a, b) / span,
                        "mfu": flops / (peak_flops * span) if peak_flops and flops else None,
                        "iterations": engine_steps(b, a),
                        "preemptions": {k: int(delta(f'orthrus_preemptions_total{{kind="{k}"}}', a, b))
                                        for k in ("embedding", "generation")}})
    n = max(len(per_gpu), 1)
    busy = sum(g["busy"] for g in per_gpu) / n
    mfus = [g["mfu"] for g in per_gpu if g["mfu"] is not None]
    preemptions = {k: int(delta(f'orthrus_preemptions_total{{kind="{k}"}}'))
                   for k in ("embedding", "generation")}
    return {
        "utilization": {"busy": busy, "idle_gpu_s": span * (n - sum(g["busy"] for g in per_gpu)),
                        "mfu": sum(mfus) / n if mfus else None, "mbu": None, "per_gpu": per_gpu},
        "budget_fill": delta("orthrus_budget_fill_sum") / max(delta("orthrus_budget_fill_count"), 1),
        "iterations": engine_steps(before, after),
        "preemptions": preemptions,
        "admission_wait_s": {k: histogram_summary(before, after, "orthrus_admission_wait_seconds",
                                                  f'kind="{k}"') for k in ("embedding", "generation")},
    }


async def measure(transport, scenario: Scenario, label: str, token_range: int,
                  scrape: Callable[[], Awaitable[str]],
                  on_progress: Callable[[float], None] | None = None) -> tuple[dict, list[dict]]:
    """Drive ``transport`` with the scenario's workload; ``scrape()`` returns the engine's
    Prometheus text. Returns the results document and the per-request rows."""
    from orthrus_real.cluster.machine_plan import refuse_simulated_stop
    from orthrus_sim.costmodel import get_hardware

    refuse_simulated_stop(scenario)
    driver = LiveDriver(transport, scenario, token_range)
    await driver.prepare()
    window = MeasurementWindow(scenario.warmup_s, parse_prometheus(await scrape()))

    async def open_window() -> None:
        await asyncio.sleep(scenario.warmup_s)
        window.open(parse_prometheus(await scrape()))

    marker = asyncio.create_task(open_window()) if scenario.warmup_s > 0 else None
    wall = time.perf_counter()
    end = await driver.run(on_progress)
    wall = time.perf_counter() - wall
    after = parse_prometheus(await scrape())
    if marker is not None and not marker.done():
        marker.cancel()
    start = window.start(end)
    metrics = driver.log.close(end, driver.workflows)
    measured = engine_metrics(window.opening, after, end - start,
                              get_hardware(scenario.hardware).peak_flops)
    metrics["admission_wait_s"] = measured.pop("admission_wait_s")
    metrics.update(measured)
    metrics.update({"retrieval_s": summary(driver.retrieval_s) if driver.retrieval_s else None,
                    "sim_end_s": end, "wall_s": wall,
                    # what vLLM's benchmark client reports too: output tokens/s and ITL
                    "output_tokens_per_s": driver.window_tokens / (end - start) if end > start else None,
                    "itl_s": driver.itl.summary()})
    metrics["warnings"] = driver.workload.warnings + window_warnings(metrics)
    if scenario.workload.phases:
        metrics["phases"] = driver.log.phase_metrics(scenario.workload.phases)
    doc = results_doc(scenario_dump(scenario), [{"configuration": label, "metrics": metrics}])
    return doc, driver.log.sample


async def bench(url: str, scenario: Scenario, label: str = "measured", token_range: int = 500,
                max_connections: int = 1024,
                on_progress: Callable[[float], None] | None = None) -> tuple[dict, list[dict]]:
    """Load a live server over HTTP."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(3600.0), limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def scrape() -> str:
            return (await client.get("/metrics")).text

        doc, rows = await measure(HttpTransport(client, model), scenario, label, token_range,
                                  scrape, on_progress)
        replicas = await served_replicas(client)
        if replicas not in (None, scenario.cluster.gpus):  # the simulation would place another cluster
            doc["runs"][0]["metrics"]["warnings"].append(
                f"the server at {url} runs {replicas} replica(s) but the scenario's cluster.gpus "
                f"is {scenario.cluster.gpus}: set it (--set cluster.gpus={replicas}) to compare "
                "with the simulator")
        return doc, rows


async def served_replicas(client: httpx.AsyncClient) -> int | None:
    """How many replicas the server runs, from its ``/health``: an Orthrus cluster lists them,
    an Orthrus engine is one; None for a server whose health check says nothing of it (stock
    vLLM answers 200 with no body)."""
    try:
        health = (await client.get("/health")).json()
    except (ValueError, httpx.HTTPError):
        return None
    if not isinstance(health, dict):
        return None
    return len(health["replicas"]) if isinstance(health.get("replicas"), list) else 1


async def bench_in_process(runner, metrics, scenario: Scenario, label: str = "measured",
                           token_range: int = 500) -> tuple[dict, list[dict]]:
    """Load an engine thread in this process (no HTTP)."""
    from prometheus_client import generate_latest

    async def scrape() -> str:
        return generate_latest(metrics.registry).decode()

    return await measure(EngineTransport(runner), scenario, label, token_range, scrape)


def stream_summary(metrics: dict) -> str:
    """One line on generation streams: output tokens/s and inter-token latency percentiles."""
    rate, itl = metrics.get("output_tokens_per_s"), metrics.get("itl_s") or {}
    if not rate or not itl.get("count"):
        return "output tokens/s: - (no streamed generation in the window)"
    ms = {k: 1000 * itl[k] for k in ("p50", "p95", "p99")}
    return (f"output tokens/s: {rate:.1f}; inter-token latency ms: p50 {ms['p50']:.1f}, "
            f"p95 {ms['p95']:.1f}, p99 {ms['p99']:.1f} ({itl['count']} gaps)")


SPREAD_METRICS = ("throughput_rps.embedding", "throughput_rps.generation", "latency_s.embedding.p50",
                  "latency_s.generation.p50", "latency_s.ttft.p50", "latency_s.tpot.p50")


def spread(runs: list[dict]) -> dict[str, dict]:
    """Run-to-run spread of repeated runs: per metric of ``SPREAD_METRICS`` measured in at least
    two, the values, their mean and coefficient of variation."""
    from orthrus_sim.experiment.results import _get

    out = {}
    for path in SPREAD_METRICS:
        values = [v for v in (_get(r["metrics"], path) for r in runs) if v]
        if len(values) >= 2:
            mean = float(np.mean(values))
            out[path] = {"values": values, "mean": mean,
                         "cv": float(np.std(values, ddof=1) / mean) if mean else None}
    return out


def mean_metrics(runs: list[dict]) -> dict:
    """The metrics of repeated runs averaged leaf by leaf (numbers present in every run)."""
    def merge(nodes):
        if all(isinstance(n, dict) for n in nodes):
            keys = set(nodes[0]).intersection(*nodes[1:])
            return {k: merge([n[k] for n in nodes]) for k in nodes[0] if k in keys}
        if all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in nodes):
            return float(np.mean(nodes))
        return nodes[0] if all(n == nodes[0] for n in nodes) else None

    return merge([r["metrics"] for r in runs])


def repeats_doc(docs: list[tuple[dict, list[dict]]]) -> tuple[dict, list[dict]]:
    """Repeated runs as one document: every run (the same configuration), and ``repeats``:
    their run-to-run spread (``spread``)."""
    doc, rows = docs[0]
    if len(docs) == 1:
        return doc, rows
    doc = {**doc, "runs": [d["runs"][0] for d, _ in docs]}
    doc["repeats"] = spread(doc["runs"])
    return doc, [row for _, r in docs for row in r]


def write_results(doc: dict, rows: list[dict], out: Path, plots: bool = True) -> Path:
    """``results.json``, the per-request CSV and the plots, as ``orthrus-sim run`` writes them."""
    out.mkdir(parents=True, exist_ok=True)
    path = write_json(doc, out / "results.json")
    label = doc["runs"][0]["configuration"]
    write_csv(out / f"requests_{safe_name(label)}.csv", rows)
    if plots and rows:
        from orthrus_sim.questions import plots as plotting  # matplotlib only when writing plots

        runs = doc["runs"]
        plotting.throughput_bars(runs, out / "throughput.png", f"{doc['scenario']['name']}: throughput")
        plotting.latency_cdfs(runs, {label: rows}, out / "latency_cdf.png",
                              f"{doc['scenario']['name']}: latency CDFs")
    return path
