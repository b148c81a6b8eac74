"""Prometheus metrics of a serving engine (scraped at GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from orthrus_real.engine.base import EngineBase

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py), so the same dashboards read both
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineMetrics:
    """Histograms fed after every iteration; gauges and request counters read at scrape time
    from the engine thread's published snapshot (so the HTTP thread never walks live state).

    ``busy_source()`` gives the seconds spent stepping so far (the step in flight included);
    model FLOPs are counted per iteration with the cost model's operator counts for the
    engine's own model.
    """

    def __init__(self, snapshot_source, busy_source=None, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.source = snapshot_source
        self.busy_source = busy_source
        self.model_flops = 0.0
        self._work = None  # (model spec, LoRA spec), set on the first step
        self.iteration_seconds = Histogram(
            "orthrus_iteration_seconds", "Time of one forward pass and emit stage",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry)
        self.batch_tokens = Histogram(
            "orthrus_batch_tokens", "Tokens in one batch unit",
            buckets=(1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192), registry=self.registry)
        self.budget_fill = Histogram(
            "orthrus_budget_fill", "Fraction of the token budget one batch used",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=self.registry)
        self.admission_wait = Histogram(
            "orthrus_admission_wait_seconds", "Arrival to first scheduled token, by request kind",
            ["kind"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                               60, 120), registry=self.registry)
        # what vLLM users chart, under vLLM's names and buckets; ``kind`` added (embedding |
        # generation) where both kinds have the figure
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token: the request reached the "
            "engine thread to its first token", ["model_name"], buckets=TTFT_BUCKETS,
            registry=self.registry)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between two output tokens of a request",
            ["model_name"], buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "The request reached the engine thread to its "
            "last output, by request kind", ["model_name", "kind"],
            buckets=REQUEST_LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Time waiting for admission (arrival to first "
            "scheduled token), by request kind", ["model_name", "kind"],
            buckets=REQUEST_LATENCY_BUCKETS, registry=self.registry)
        self._last_token_at: dict[str, float] = {}  # generation requests: their last output
        self._tokens = {"embed_chunk": 0, "prefill_chunk": 0, "decode": 0}
        self.registry.register(self)

    @classmethod
    def attach(cls, runner, model_name: str = "") -> EngineMetrics:
        """Metrics fed by an ``EngineThread``'s steps, outputs and snapshots."""
        metrics = cls(lambda: runner.snapshot, runner.busy_seconds, model_name)
        runner.on_step = metrics.on_step
        runner.on_output = metrics.on_output
        runner.on_done = metrics.forget
        return metrics

    def _flops(self, engine: EngineBase, shape) -> float:
        from orthrus_sim.costmodel import LoRASpec, get_model, iteration_work

        if self._work is None:
            rank = getattr(engine, "adapter_rank", None)
            self._work = (get_model(str(engine.model_dir)), LoRASpec(rank) if rank else None)
        return iteration_work(self._work[0], shape, self._work[1])[0]

    def on_step(self, engine: EngineBase) -> None:
        s = engine.stats[-1]
        self.model_flops += self._flops(engine, s.shape)
        self.iteration_seconds.observe(s.seconds)
        self.batch_tokens.observe(s.total_tokens)
        self.budget_fill.observe(s.total_tokens / s.token_budget)
        self._tokens["embed_chunk"] += s.embed_tokens
        self._tokens["prefill_chunk"] += s.prefill_tokens
        self._tokens["decode"] += s.decodes
        for kind, wait in s.admitted:
            self.admission_wait.labels(kind).observe(wait)
            self.queue_time.labels(self.model_name, kind).observe(wait)

    def forget(self, request_id: str) -> None:
        """A request left (finished, aborted or failed)."""
        self._last_token_at.pop(request_id, None)

    def on_output(self, out, submitted: float, now: float) -> None:
        """One output delivered (engine thread): TTFT, inter-token and end-to-end latency."""
        rid = out.request_id
        if out.kind == "generation" and out.new_token_ids:
            last = self._last_token_at.get(rid)
            if last is None:
                self.ttft.labels(self.model_name).observe(now - submitted)
            else:
                gap = (now - last) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    self.itl.labels(self.model_name).observe(gap)
            self._last_token_at[rid] = now
        if out.finished:
            self.forget(rid)
            if out.finish_reason not in ("abort", "error"):
                self.e2e.labels(self.model_name, out.kind).observe(now - submitted)

    @staticmethod
    def _policy_families(p):
        """Gauges and counters from the policy's snapshot (``PolicySnapshot``)."""
        depth = GaugeMetricFamily("orthrus_queue_depth", "Requests waiting for admission", labels=["kind"])
        depth.add_metric(["embedding"], p.embeddings_waiting)
        depth.add_metric(["generation"], p.generations_waiting)
        yield depth
        running = GaugeMetricFamily("orthrus_running", "Requests holding KV blocks", labels=["kind"])
        running.add_metric(["embedding"], p.embeddings_running)
        running.add_metric(["generation"], p.generations_running)
        yield running
        work = GaugeMetricFamily("orthrus_waiting_work_tokens",
                                 "Remaining work IBS weighs each queue with (we, wg)", labels=["kind"])
        work.add_metric(["embedding"], p.embedding_work)
        work.add_metric(["generation"], p.generation_work)
        yield work
        yield GaugeMetricFamily("orthrus_kv_blocks_used", "KV-cache blocks allocated",
                                value=p.kv_blocks_used)
        yield GaugeMetricFamily("orthrus_kv_blocks_total", "KV-cache blocks in the pool",
                                value=p.kv_blocks_total)
        yield GaugeMetricFamily("orthrus_kv_cache_usage", "Fraction of KV blocks allocated",
                                value=p.kv_usage)
        if p.credits is not None:
            g = GaugeMetricFamily("orthrus_ibs_credits", "IBS credits in tokens (persist across "
                                  "iterations)", labels=["queue"])
            for k, v in p.credits.items():
                g.add_metric([k], v)
            yield g
        pre = CounterMetricFamily("orthrus_preemptions", "Recompute preemptions, by request kind",
                                  labels=["kind"])
        for k, v in p.preemptions.items():
            pre.add_metric([k], v)
        yield pre

    def describe(self):
        return []

    def collect(self):
        snap = self.source()
        policy = snap.get("policy")
        if policy is not None:
            yield from self._policy_families(policy)
        tokens = CounterMetricFamily("orthrus_batch_tokens_by_type", "Tokens scheduled, by item type",
                                     labels=["type"])
        for k, v in self._tokens.items():
            tokens.add_metric([k], v)
        yield tokens
        reqs = CounterMetricFamily("orthrus_requests", "Requests that ended, by kind and outcome",
                                   labels=["kind", "outcome"])
        for key, v in snap.get("counters", {}).items():
            kind, outcome = key.split("_", 1)
            reqs.add_metric([kind, outcome], v)
        yield reqs
        yield CounterMetricFamily("orthrus_iterations", "Forward passes run",
                                  value=snap.get("iterations", 0))
        if self.busy_source is not None:
            yield CounterMetricFamily("orthrus_busy_seconds", "Seconds spent running iterations "
                                      "(the one in flight included)", value=self.busy_source())
        yield CounterMetricFamily("orthrus_model_flops", "Model FLOPs of the iterations run "
                                  "(the cost model's operator counts)", value=self.model_flops)
        yield GaugeMetricFamily("orthrus_requests_in_flight", "Requests accepted and not finished",
                                value=snap.get("outstanding", 0))
