"""Scenario files: YAML validated with pydantic; an error names the field path and the problem.

A scenario describes one experiment: hardware, model, scheduler knobs, the workload's load model
(``workload``) and the configurations to compare. Paths inside it (calibration, trace, empirical
length files) are relative to the scenario file's folder; a calibration may also be the name of a
shipped one (``a100-40gb``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import random
import re
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from orthrus_sim import read_structured, resolve_path
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.engine.registry import resolve_policy
from orthrus_sim.experiment.distributions import LengthDist, Uniform, fixed
from orthrus_sim.experiment.trace import FORMAT_NAMES, Window, trace_format, window


def shipped_calibrations() -> dict[str, Path]:
    """Calibrations that ship with the project, by name (file stem)."""
    from orthrus_sim import data_dir

    return {p.stem: p for p in sorted(data_dir("calibration").glob("*.json"))}


ROOFLINE = "roofline"  # ``calibration: roofline``: no calibration file, the assumed efficiencies


def hardware_calibration(hardware: str) -> str | None:
    """The shipped calibration made for ``hardware`` (named after it), or None."""
    path = shipped_calibrations().get(hardware)
    return str(path) if path else None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class EmbeddingSection(Strict):
    lora_rank: int | None = Field(default=16, ge=1, description="null: no adapter")
    lora_targets: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                               "down_proj"]
    pooling: Literal["mean", "weighted-mean", "cls", "last"] = "mean"
    bidirectional: bool = Field(default=False, description="a bidirectional embedder cannot be chunked")
    model: str | None = Field(default=None, description="dedicated embedding model (default: the base)")
    max_input_tokens: int | None = Field(default=None, ge=1, description="the longest input the "
                                         "embedder takes (e5-mistral: 4096); a trace's longer "
                                         "embedding inputs are cut to it (default: the model's "
                                         "positions)")


class ClusterSection(Strict):
    gpus: int = Field(default=1, ge=1)
    router: Literal["round-robin", "least-work", "least-predicted-time", "adaptive"] = Field(
        default="round-robin", description="round-robin | least-work (outstanding tokens) | "
        "least-predicted-time (where the replica's cost model predicts the request done first; "
        "docs/routing.md) | adaptive (unified replicas with scheduler.tpot_target_s: generations "
        "packed onto as few replicas as hold the target, embeddings where they finish first)")
    adaptive_pack: float = Field(default=1.0, gt=0, le=1, description="adaptive router: pack a "
                                 "replica's generations up to this fraction of the target")
    objective: Literal["throughput", "goodput"] = Field(
        default="throughput", description="adaptive router: what its placement planner "
        "maximises: normalised throughput, or normalised goodput (the kinds whose predicted "
        "latencies meet the slo section's bounds; then throughput)")
    memory_utilization: float = Field(default=0.9, gt=0, le=1)
    role_change_s: float = Field(default=60.0, ge=0, description="dedicated-replan: seconds a "
                                 "GPU serves nothing while it changes role (embedding <-> "
                                 "generation), after its requests in flight drained")
    front_end: Literal["per-replica", "shared"] = Field(
        default="per-replica", description="where a request pays the calibration's per-request "
        "server overheads (cost factors embedding_overhead_s, generation_overhead_s), one "
        "request at a time: each replica's own server (per-replica), or one process in front "
        "of the whole cluster before the request is routed (shared: one API server or "
        "benchmark client for every GPU, so the kinds' overheads queue behind each other)")


class _SchedulerExtras(Strict):
    """What a scenario's scheduler section holds beside ``SchedulerConfig``'s own fields."""

    policy: str | None = Field(default=None, description="policy for the 'orthrus' configuration")
    generation_token_budget: int | None = Field(default=None, ge=1,
                                                description="budget of dedicated generation replicas")
    embedding_token_budget: int | None = Field(
        default=None, ge=1, description="budget of dedicated embedding replicas (a stock pooling "
        "server's batch: vLLM's pooling runner takes up to 32,768 tokens of whole inputs and "
        "max_num_seqs of them); default: token_budget")

    @field_validator("policy")
    @classmethod
    def _policy_imports(cls, v):
        if v is not None:
            resolve_policy(v)
        return v

    @model_validator(mode="after")
    def _checked_by_the_core(self):
        self.config()  # SchedulerConfig's own checks (chunk <= budget, choices): one definition
        return self

    @classmethod
    def validated(cls, raw: dict, source: str, overrides: list[tuple[str, str]] = ()):
        """The section of ``raw`` alone (the CLIs' settings without a scenario)."""
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ValueError(_format(exc, source, overrides, ("scheduler",), "invalid")) from None

    def config(self, **changes) -> SchedulerConfig:
        """The ``SchedulerConfig`` of this section: every field of it, ``changes`` applied
        (``num_blocks`` left to the memory model stands in as the core's default here)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerConfig)}
        if values["num_blocks"] is None:
            values["num_blocks"] = SCHEDULER_DEFAULTS.num_blocks
        return SchedulerConfig(**{**values, **changes})


SCHEDULER_DEFAULTS = SchedulerConfig()
# Fields whose scenario default differs from the core's (num_blocks: sized by the memory model).
_SCENARIO_DEFAULTS: dict[str, tuple[Any, Any, str]] = {
    "num_blocks": (int | None, None, "default: from the memory model"),
    "tpot_target_s": (float | None, None, "iteration-time target (s) for the iterations of "
                      "unified replicas that carry decodes (docs/scheduler.md)"),
    "waiting_work": (str | None, None, "prompt | prompt+output; default: prompt+output where "
                     "tpot_target_s is set, else prompt"),
}


def _scheduler_section() -> type[_SchedulerExtras]:
    """``SchedulerSection``: one field per ``SchedulerConfig`` field, with its type and
    default, so a field added to the core reaches scenarios (and ``--set``) by itself; the
    values are checked by the core's own ``__post_init__``."""
    hints = typing.get_type_hints(SchedulerConfig)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(SchedulerConfig):
        typ, default, help_ = _SCENARIO_DEFAULTS.get(
            f.name, (hints[f.name], getattr(SCHEDULER_DEFAULTS, f.name), None))
        fields[f.name] = (typ, Field(default=default, description=help_))
    return create_model("SchedulerSection", __base__=_SchedulerExtras, **fields)


SchedulerSection = _scheduler_section()


class SloSection(Strict):
    """Service-level objectives, as vLLM's ``bench serve --goodput`` and DistServe define them:
    a request meets them when it finished and every bound given for its kind holds (a kind with
    none given: finishing is enough). Any subset; every bound in seconds."""

    ttft_s: float | None = Field(default=None, gt=0, description="generation: arrival to first "
                                                                 "token")
    tpot_s: float | None = Field(default=None, gt=0, description="generation: time per output "
                                 "token, (e2e - ttft) / (output tokens - 1) per request")
    e2e_s: float | None = Field(default=None, gt=0, description="generation: arrival to finish")
    latency_s: float | None = Field(default=None, gt=0, description="embedding: arrival to finish")

    @model_validator(mode="after")
    def _some_bound(self):
        if all(v is None for v in (self.ttft_s, self.tpot_s, self.e2e_s, self.latency_s)):
            raise ValueError("give at least one of ttft_s, tpot_s, e2e_s (generation) or "
                             "latency_s (embedding), or leave the slo section out")
        return self

    def bounds(self, kind: str) -> dict[str, float]:
        """The bounds given for ``kind`` (embedding or generation), by field name."""
        names = ("latency_s",) if kind == "embedding" else ("ttft_s", "tpot_s", "e2e_s")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


class Arrival(Strict):
    """The default load: one pool whose clients (or arrivals) draw their kind from the mix, or,
    with ``pools: per-kind``, closed-loop clients split between the kinds by the generation
    share (``round(clients x share)`` generation clients), each keeping its kind."""

    process: Literal["closed-loop", "poisson", "gamma", "burst"] = "closed-loop"
    pools: Literal["mixed", "per-kind"] = "mixed"
    clients: int = Field(default=64, ge=1, description="closed-loop clients")
    think_time_s: float = Field(default=0.0, ge=0)
    ramp_s: float = Field(default=0.0, ge=0, description="closed loop: clients start spread "
                                                         "evenly over this many seconds")
    rate: float | None = Field(default=None, gt=0, description="open-loop arrivals per second")
    cv: float = Field(default=1.0, gt=0, description="gamma: coefficient of variation")

    @model_validator(mode="after")
    def _rate(self):
        if self.process in ("poisson", "gamma") and self.rate is None:
            raise ValueError(f"process {self.process!r} needs 'rate' (arrivals per second)")
        if self.pools == "per-kind" and self.process != "closed-loop":
            raise ValueError("pools 'per-kind' splits closed-loop clients; an open-loop mix "
                             "already is two independent arrival streams")
        return self


def pool_stream(stream: str | None, position: int, phase: int | None = None) -> str:
    """A pool's stream (what names its clients and seeds their draws): its own ``stream``, or
    its position (``i`` among the workload's pools, ``p.j`` for pool j of phase p): the one
    rule the validator, the generator and ``only_kind`` share."""
    if stream:
        return stream
    return str(position) if phase is None else f"{phase}.{position}"


class Pool(Strict):
    """One source of load with its own arrival process.

    ``kind``: ``embedding`` or ``generation`` (every request of that kind), ``mixed`` (each
    request draws its kind from ``generation_share``, the workload's by default), ``workflow``
    (Iter-RetGen workflows, from the ``iter_retgen`` section). ``closed-loop``: ``clients``
    clients, each sending its next request ``think_time_s`` (exponential mean) after the last
    ended, started evenly over ``ramp_s``; ``poisson``/``gamma``: ``rate`` arrivals per second
    (gamma with coefficient of variation ``cv``); ``mmpp``, ``diurnal``: bursty open loops
    (``orthrus_sim.experiment.arrivals``); ``burst``: ``count`` arrivals at the start;
    ``trace``: the requests of a trace file (``trace``, ``format``) in the window ``start_s``,
    ``length_s``, their time scaled to a mean of ``rate`` per second where it is given: a
    kindless trace (every public format) is one kind's stream, and two such pools, one per
    kind, merge into one mixed workload.
    """

    kind: Literal["embedding", "generation", "mixed", "workflow"] = "mixed"
    process: Literal["closed-loop", "poisson", "gamma", "burst", "trace", "mmpp",
                     "diurnal"] = "closed-loop"
    clients: int = Field(default=64, ge=1)
    think_time_s: float = Field(default=0.0, ge=0)
    ramp_s: float = Field(default=0.0, ge=0)
    rate: float | None = Field(default=None, gt=0, description="open loop: arrivals per second "
                               "(mmpp: in the on state; diurnal: the curve's mean; trace: the "
                               "window's mean, reached by scaling its time)")
    cv: float = Field(default=1.0, gt=0)
    off_rate: float = Field(default=0.0, ge=0, description="mmpp: arrivals per second when off")
    on_s: float | None = Field(default=None, gt=0, description="mmpp: mean on duration (s)")
    off_s: float | None = Field(default=None, gt=0, description="mmpp: mean off duration (s)")
    correlate: str | None = Field(default=None, description="mmpp: pools naming the same group "
                                  "share one on/off sequence (default: a sequence of its own)")
    period_s: float | None = Field(default=None, gt=0, description="diurnal: the curve's period")
    amplitude: float = Field(default=0.5, ge=0, le=1, description="diurnal sine: relative swing")
    phase_s: float = Field(default=0.0, description="diurnal: the curve shifted by this")
    profile: list[float] | None = Field(default=None, min_length=1, description="diurnal: "
                                        "piecewise levels over equal slices of the period "
                                        "(relative; scaled to mean 'rate'), instead of the sine")
    count: int | None = Field(default=None, ge=1, description="burst: arrivals at the start")
    trace: str | None = Field(default=None, description="process trace: the file replayed "
                              "(orthrus_sim/experiment/trace.py: the formats)")
    format: Literal[FORMAT_NAMES] = Field(  # type: ignore[valid-type]
        default="auto", description="trace: the file's format; auto: from its header")
    start_s: float = Field(default=0.0, ge=0, description="trace: the window's start, in the "
                           "trace's own seconds")
    length_s: float | None = Field(default=None, gt=0, description="trace: the window's length "
                                   "in the trace's seconds (default: to its end)")
    tokens_scale: float = Field(default=1.0, gt=0, description="trace: every row's input and "
                                "output tokens times this (rounded, at least 1): a trace "
                                "shrunk to a small model's scale, its bursts and its mix of "
                                "lengths kept")
    generation_share: float | None = Field(default=None, ge=0, le=1)
    stream: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_.-]+$",
        description="names the pool's request streams (its clients' names, p<stream>c<k>, and "
                    "their random draws); default: the pool's position (a phase's: "
                    "<phase>.<position>). A pool keeps its requests under another position "
                    "with its old name: a dedicated server benched with one kind's pool "
                    "(bench --only) sends what that pool sends in the whole scenario")

    @field_validator("trace")
    @classmethod
    def _trace_path(cls, v, info: ValidationInfo):
        return v if v is None else str(resolve_path(v, info))

    @model_validator(mode="after")
    def _consistent(self):
        if self.process in ("poisson", "gamma", "mmpp", "diurnal") and self.rate is None:
            raise ValueError(f"process {self.process!r} needs 'rate' (arrivals per second)")
        if self.process == "mmpp" and (self.on_s is None or self.off_s is None):
            raise ValueError("process 'mmpp' needs on_s and off_s (mean seconds on and off)")
        if self.process == "diurnal" and self.period_s is None:
            raise ValueError("process 'diurnal' needs period_s (the curve's period)")
        if self.profile is not None and (min(self.profile) < 0 or sum(self.profile) <= 0):
            raise ValueError("profile: levels must be >= 0, not all 0")
        if (self.process == "trace") != (self.trace is not None):
            raise ValueError("process 'trace' and 'trace: path/to/file' go together")
        if self.process == "trace":
            fmt = trace_format(self.trace, self.format)  # every row checked now
            if self.kind not in ("embedding", "generation") and fmt != "orthrus":
                raise ValueError(f"trace {self.trace} ({fmt}) has no kind column: give the "
                                 "pool kind embedding or generation (one kind's stream)")
            if self.kind == "workflow":
                raise ValueError("a trace pool replays requests, not workflows")
            self.replay()
        elif self.tokens_scale != 1.0:
            raise ValueError("tokens_scale scales a trace's lengths: it needs process 'trace' "
                             "(other processes draw theirs from the workload's distributions)")
        if self.process == "burst" and self.count is None:
            raise ValueError("process 'burst' needs 'count' (arrivals at the start)")
        if self.generation_share is not None and self.kind != "mixed":
            raise ValueError(f"generation_share applies to kind 'mixed' only, not {self.kind!r}")
        return self

    def replay(self, scale: float = 1.0) -> Window:
        """The trace window this pool replays (process ``trace``), its time also divided by
        ``scale`` (``workload.rate_scale``)."""
        return window(self.trace, self.format, self.start_s, self.length_s, self.rate, scale,
                      self.tokens_scale)


class BurstGroup(Strict):
    kind: Literal["embedding", "generation"]
    count: int = Field(ge=1)


class Phase(Strict):
    """A stretch of the workload with its own mix: it lasts ``duration_s`` or ``requests``
    units of work (requests, or workflows), whichever the phase gives. A timed phase may bring
    its own ``pools``, which run during that phase only."""

    duration_s: float | None = Field(default=None, gt=0)
    requests: int | None = Field(default=None, ge=1)
    generation_share: float | None = Field(default=None, ge=0, le=1)
    pools: list[Pool] = []

    @model_validator(mode="after")
    def _one_length(self):
        if (self.duration_s is None) == (self.requests is None):
            raise ValueError("give exactly one of duration_s or requests")
        if self.pools and self.requests is not None:
            raise ValueError("pools: only a phase with duration_s can bring its own pools")
        if self.generation_share is None and not self.pools:
            raise ValueError("give generation_share, or pools for this phase")
        return self


class Drift(Strict):
    """The mix as a seeded random walk (``scenarios/drift.yaml``): every ``every_s`` the
    generation share moves ``step`` up or down, each equally likely, kept within ``[low,
    high]``, from ``start``; it becomes timed phases over ``duration_s`` (drawn from the
    scenario's seed, so a run and its live replay see the same walk)."""

    every_s: float = Field(default=10.0, gt=0)
    step: float = Field(default=0.1, gt=0, le=1)
    low: float = Field(default=0.1, ge=0, le=1)
    high: float = Field(default=0.9, ge=0, le=1)
    start: float = Field(default=0.5, ge=0, le=1)

    @model_validator(mode="after")
    def _ordered(self):
        if not self.low <= self.start <= self.high:
            raise ValueError(f"drift: need low <= start <= high, got {self.low}, {self.start}, "
                             f"{self.high}")
        return self

    def phases(self, duration_s: float, seed: int) -> list[Phase]:
        rng = random.Random(f"{seed}-drift")
        share, out, t = self.start, [], 0.0
        while t < duration_s:
            span = min(self.every_s, duration_s - t)
            out.append(Phase(duration_s=span, generation_share=round(share, 6)))
            share = min(self.high, max(self.low, share + rng.choice((-1, 1)) * self.step))
            t += span
        return out


class IterRetGen(Strict):
    iterations: int = Field(default=2, ge=1)
    docs_per_query: LengthDist = Field(
        default_factory=lambda: Uniform(dist="uniform", low=1, high=10))
    doc_tokens: LengthDist = Field(default_factory=lambda: fixed(100))
    question_tokens: LengthDist = Field(default_factory=lambda: fixed(32))
    output_tokens: LengthDist = Field(default_factory=lambda: fixed(256))
    retrieval_latency_s: float = Field(default=0.0, ge=0)
    max_prompt_tokens: int | None = Field(default=None, ge=1)
    corpus_size: int = Field(default=256, ge=1, description="documents in the retrieval corpus")
    retrieval: Literal["seeded", "vector"] = Field(
        default="seeded", description="seeded: documents drawn from the workflow's seed (the same "
        "in simulated and live runs); vector: a live run searches the corpus with the returned "
        "embedding (the simulator, which has no vectors, draws them as 'seeded' does)")


class Workload(Strict):
    kind: Literal["synthetic", "iter-retgen", "trace"] = "synthetic"
    arrival: Arrival | None = Field(default=None, description="the default pool (default: 64 "
                                    "closed-loop clients); null when pools or a trace give the load")
    generation_share: float = Field(default=0.5, ge=0, le=1)
    pools: list[Pool] = Field(default=[], description="sources of load; default: one pool from "
                                                      "'arrival' (and 'burst')")
    embedding_input: LengthDist = Field(default_factory=lambda: fixed(128))
    generation_prompt: LengthDist = Field(default_factory=lambda: fixed(128))
    generation_output: LengthDist = Field(default_factory=lambda: fixed(512))
    burst: list[BurstGroup] = []
    phases: list[Phase] = []
    drift: Drift | None = Field(default=None, description="the mix as a seeded random walk, "
                                "in timed phases over duration_s (a mixed pool)")
    iter_retgen: IterRetGen = Field(default_factory=IterRetGen)
    trace: str | None = None
    rate_scale: float = Field(default=1.0, gt=0, description="the open load scaled: every "
                              "open-loop pool's rates times this, every trace pool's time "
                              "compressed by it (closed loops are left as they are)")

    @field_validator("trace")
    @classmethod
    def _trace_path(cls, v, info: ValidationInfo):
        if v is None:
            return v
        path = resolve_path(v, info)
        fmt = trace_format(path)  # every row is checked now: an error names the file and line
        if fmt != "orthrus":
            raise ValueError(f"trace {path} ({fmt}) has no kind column: replay it as a pool "
                             "(pools: [{kind: generation, process: trace, trace: ...}])")
        return str(path)

    @model_validator(mode="after")
    def _consistent(self):
        a = self.arrival
        if self.kind == "trace" and not self.trace:
            raise ValueError("kind 'trace' needs 'trace: path/to/file.jsonl|csv'")
        if self.pools and (a is not None or self.burst):
            raise ValueError("give either pools, or arrival (and burst): pools replace them")
        if self.kind == "trace" and (self.pools or a is not None):
            raise ValueError("a trace replays its own arrivals: drop pools and arrival")
        if a is not None and a.process == "burst" and self.kind == "synthetic" and not self.burst:
            raise ValueError("arrival.process 'burst' needs a 'burst' list of {kind, count}")
        if a is not None and a.pools == "per-kind" and self.phases \
                and self.phases[0].requests is not None:
            raise ValueError("arrival.pools 'per-kind' splits the clients once, by generation_share; "
                             "phases by request count change the mix of a mixed pool (use pools: mixed)")
        if self.kind != "iter-retgen":
            for pool in self.pools + [p for ph in self.phases for p in ph.pools]:
                if pool.kind == "workflow":
                    raise ValueError("pools: kind 'workflow' needs workload.kind 'iter-retgen'")
        streams = [pool_stream(p.stream, i) for i, p in enumerate(self.pools)]
        streams += [pool_stream(p.stream, j, n) for n, ph in enumerate(self.phases)
                    for j, p in enumerate(ph.pools)]
        twice = sorted({s for s in streams if streams.count(s) > 1})
        if twice:
            raise ValueError(f"pools: stream {twice[0]!r} names two pools (each pool's requests "
                             "need a stream of their own)")
        groups: dict[str, tuple] = {}
        for pool in self.pools + [p for ph in self.phases for p in ph.pools]:
            if pool.correlate and groups.setdefault(pool.correlate, (pool.on_s, pool.off_s)) \
                    != (pool.on_s, pool.off_s):
                raise ValueError(f"pools: correlate group {pool.correlate!r} shares one on/off "
                                 "sequence: give its pools the same on_s and off_s")
        by_time = [p.duration_s is not None for p in self.phases]
        if any(by_time) and not all(by_time):
            raise ValueError("phases: give every phase a duration_s, or every phase a requests count")
        return self

    def default_pools(self) -> list[Pool]:
        """The pools the workload runs when none are listed: one pool from ``arrival`` (a
        workflow pool for Iter-RetGen), or one burst pool per ``burst`` group."""
        if self.pools:
            return list(self.pools)
        if self.arrival is None and any(p.pools for p in self.phases):
            return []  # the phases bring all the load
        a = self.arrival or Arrival()
        kind = "workflow" if self.kind == "iter-retgen" else "mixed"
        if a.process == "burst" and kind == "mixed":
            return [Pool(kind=g.kind, process="burst", count=g.count) for g in self.burst]
        if a.pools == "per-kind" and kind == "mixed":
            n_gen = round(a.clients * self.generation_share)
            return [Pool(kind=k, clients=n, think_time_s=a.think_time_s, ramp_s=a.ramp_s)
                    for k, n in (("embedding", a.clients - n_gen), ("generation", n_gen)) if n]
        return [Pool(kind=kind, process=a.process, clients=a.clients, think_time_s=a.think_time_s,
                     ramp_s=a.ramp_s, rate=a.rate, cv=a.cv,
                     count=a.clients if a.process == "burst" else None)]


CONFIG_RE = re.compile(
    r"^(orthrus|unified-hetero|unified-homo|dedicated-(\d+):(\d+)|disagg-pd-(\d+):(\d+)|unified:.+"
    r"|dedicated-replan(-(\d+):(\d+))?)$"
)


class Scenario(Strict):
    name: str
    seed: int = 0
    duration_s: float | None = Field(default=None, gt=0)
    num_requests: int | None = Field(default=None, ge=1)
    warmup_s: float = Field(default=0.0, ge=0, description="the measurement window starts here: "
                                                           "requests arriving earlier are not counted")
    hardware: str = "a100-40gb"
    model: str = "mistral-7b-v0.1"
    embedding: EmbeddingSection = Field(default_factory=EmbeddingSection)
    calibration: str | None = Field(default=None, description=(
        "a calibration file or the name of a shipped one; by default the shipped calibration "
        "of the scenario's hardware where there is one; 'roofline': the roofline with assumed "
        "efficiencies"))
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)  # type: ignore[valid-type]
    workload: Workload = Field(default_factory=Workload)
    configurations: list[str] = ["orthrus"]
    slo: SloSection | None = Field(default=None, description="SLOs for attainment and goodput")
    max_sim_time_s: float = Field(default=36_000.0, gt=0)
    stop_below_attainment: float | None = Field(
        default=None, gt=0, le=1, description="stop the run as soon as a kind's SLO attainment "
        "can no longer reach this: its misses exceed (1 - this) of the requests of that kind "
        "the workload sends (counted before the run: trace rows, burst counts, a dry run of an "
        "open loop; no stop for a kind a closed loop sends). The simulator's only (a measured "
        "run is not stopped): for a search that asks only pass or fail (capacity); the metrics "
        "of a stopped run say stopped_early and cover the run until then")
    timeline_interval_s: float = Field(default=1.0, gt=0)

    @property
    def calibration_file(self) -> str | None:
        """The calibration file the cost model reads (None: the roofline's assumed efficiencies)."""
        return None if self.calibration in (None, ROOFLINE) else self.calibration

    @field_validator("configurations")
    @classmethod
    def _configs(cls, v):
        if not v:
            raise ValueError("list at least one configuration")
        for name in v:
            if name in ("dedicated", "disagg-pd"):
                raise ValueError(
                    f"configuration {name!r}: name the split it compares, e.g. "
                    f"{name}-1:3 or {name}-2:2 (GPUs for embeddings:generation, or prefill:decode)")
            if not CONFIG_RE.match(name):
                raise ValueError(
                    f"unknown configuration {name!r}; use dedicated-N:M, dedicated-replan[-N:M], "
                    "disagg-pd-P:D, "
                    "unified-homo, unified-hetero, orthrus, or unified:<policy name or module:Class>"
                )
            if name.startswith("unified:"):
                resolve_policy(name.split(":", 1)[1])
        return v

    @field_validator("calibration")
    @classmethod
    def _calibration(cls, v, info: ValidationInfo):
        if v is None or v == ROOFLINE:
            return v
        path = resolve_path(v, info, must_exist=False)
        if path.exists():
            return str(path)
        shipped = shipped_calibrations()
        if v in shipped:
            return str(shipped[v])
        raise ValueError(f"calibration: no file {path} and no shipped calibration named {v!r} "
                         f"(shipped: {', '.join(shipped) or 'none'})")

    @model_validator(mode="after")
    def _cross_checks(self):
        from orthrus_sim.costmodel import get_hardware, get_model

        get_hardware(self.hardware)
        if self.calibration is None:  # the hardware's own calibration, where one ships
            self.calibration = hardware_calibration(self.hardware)
        limit = get_model(self.model).max_position_embeddings
        if self.scheduler.max_model_len is not None and self.scheduler.max_model_len > limit:
            raise ValueError(f"scheduler.max_model_len ({self.scheduler.max_model_len}) exceeds "
                             f"the model's max_position_embeddings ({limit}) of {self.model!r}")
        if self.embedding.model:
            get_model(self.embedding.model)
        w = self.workload
        if w.drift is not None:
            if self.duration_s is None:
                raise ValueError("workload.drift needs duration_s: the walk spans it")
            walk = w.drift.phases(self.duration_s, self.seed)
            if w.phases and w.phases != walk:
                raise ValueError("workload.drift writes the phases itself: give drift or phases")
            w.phases = walk
        if w.phases and w.phases[0].duration_s is not None and self.duration_s is None:
            self.duration_s = sum(p.duration_s for p in w.phases)
        counted = bool(w.phases) and w.phases[0].requests is not None
        bursts_only = all(p.process in ("burst", "trace") for p in w.default_pools())
        open_ended = w.kind != "trace" and not bursts_only and not counted
        if open_ended and self.duration_s is None and self.num_requests is None:
            raise ValueError("give duration_s or num_requests: the workload never ends by itself")
        if self.duration_s is not None and self.warmup_s >= self.duration_s:
            raise ValueError(f"warmup_s ({self.warmup_s}) must be shorter than duration_s "
                             f"({self.duration_s}): the measurement window would be empty")
        if self.embedding.bidirectional and self.scheduler.chunk_size is not None:
            raise ValueError("embedding.bidirectional: a bidirectional embedder cannot be chunked "
                             "exactly; set scheduler.chunk_size: null (atomic embeddings)")
        unified = [c for c in self.configurations if is_unified(c)]
        if self.cluster.router == "adaptive" and unified and self.scheduler.tpot_target_s is None:
            raise ValueError(f"cluster.router: adaptive places {', '.join(unified)} by the "
                             "iteration-time target: set scheduler.tpot_target_s")
        if self.stop_below_attainment is not None and self.slo is None:
            raise ValueError("stop_below_attainment stops a run by its SLO attainment: give the "
                             "slo section (ttft_s, tpot_s, e2e_s, latency_s)")
        if self.cluster.objective == "goodput":
            if self.slo is None:
                raise ValueError("cluster.objective: goodput counts the requests that meet the "
                                 "SLOs: give the slo section (ttft_s, tpot_s, e2e_s, latency_s)")
            if self.cluster.router != "adaptive":
                raise ValueError("cluster.objective: goodput is what the adaptive router's "
                                 f"placement planner maximises; cluster.router is "
                                 f"{self.cluster.router!r} (set it to adaptive, or leave the "
                                 "objective at throughput)")
        return self


UNIFIED = ("orthrus", "unified-hetero", "unified-homo")
REPLAN = "dedicated-replan"  # a dedicated split whose GPUs change role as the demand moves


def is_replan(configuration: str) -> bool:
    """``dedicated-replan``, from the planner's split or a given one (``dedicated-replan-E:G``)."""
    return configuration == REPLAN or configuration.startswith(REPLAN + "-")


def is_unified(configuration: str) -> bool:
    """A configuration whose every GPU serves both kinds (``unified:<policy>`` included)."""
    return configuration in UNIFIED or configuration.startswith("unified:")


def split_gpus(name: str, gpus: int) -> tuple[int, int] | None:
    """GPUs of the two pools of a split configuration (embedding:generation for dedicated,
    prefill:decode for disagg-pd; the split ``dedicated-replan-E:G`` starts from); None for
    unified ones and ``dedicated-replan`` (whose split the simulator's planner picks)."""
    m = CONFIG_RE.match(name)
    if is_replan(name) and gpus < 2:
        raise ValueError(f"configuration {name!r} needs at least 2 GPUs (one per role: a split "
                         f"of one GPU cannot serve both kinds), cluster.gpus is {gpus}")
    if name == REPLAN:
        return None
    if is_replan(name):
        a, b = int(m.group(7)), int(m.group(8))
    elif name.startswith("dedicated"):
        a, b = int(m.group(2)), int(m.group(3))
    elif name.startswith("disagg-pd"):
        a, b = int(m.group(4)), int(m.group(5))
    else:
        return None
    if a + b != gpus:
        raise ValueError(f"configuration {name!r} uses {a + b} GPUs but cluster.gpus is {gpus}")
    if name.startswith("disagg-pd") and (a < 1 or b < 1):
        raise ValueError(f"configuration {name!r} needs at least one prefill and one decode GPU")
    if is_replan(name) and (a < 1 or b < 1):
        raise ValueError(f"configuration {name!r} needs at least one embedding and one "
                         "generation GPU to start from (a side emptied refuses its kind)")
    return a, b


def _model_at(path: list[str]) -> type[BaseModel] | None:
    """The section model a dotted location names (list items and ``X | None`` unwrapped)."""
    model: Any = Scenario
    for key in path:
        if key.isdigit():
            continue
        field = model.model_fields.get(key) if isinstance(model, type) else None
        if field is None:
            return None
        model = _section_type(field.annotation)
        if model is None:
            return None
    return model


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_type(arg)
        if found is not None:
            return found
    return None


def did_you_mean(loc: str) -> str:
    """`` (did you mean 'x'?)`` for a location whose last key is a near miss of a field."""
    *parent, key = loc.split(".")
    model = _model_at(parent)
    names = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    return f" (did you mean {'.'.join([*parent, close[0]])!r}?)" if close else ""


def _format(exc: ValidationError, source: str, overrides: list[tuple[str, str]] = (),
            prefix: tuple[str, ...] = (), what: str = "invalid scenario") -> str:
    """One line per problem, named by its field path; a problem in a field that an override
    set names that override (``--set k=v``, ``--grid k=v``) rather than the file."""
    lines = [f"{source}: {what}"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in (*prefix, *err["loc"])
                       if not str(p).startswith("function-after"))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg += did_you_mean(loc)
        blamed = [f"{flag} {item}" for flag, item in overrides
                  if _touches(item.partition("=")[0].strip(), loc, msg)]
        where = f" (from {', '.join(blamed)})" if blamed else ""
        if loc and msg.startswith(loc + "."):  # the core's messages name the field themselves
            lines.append(f"  {msg}{where}")
        else:
            lines.append(f"  {loc or '(top level)'}{where}: {msg}")
    return "\n".join(lines)


def _touches(path: str, loc: str, msg: str) -> bool:
    if not loc:
        return path in msg
    return path == loc or path.startswith(loc + ".") or loc.startswith(path + ".") or path in msg


def apply_overrides(raw: dict, overrides: list[str], flag: str = "--set") -> dict:
    """``section.key=value`` overrides on a copy; the value is parsed as YAML (lists, null).
    A number addresses a list item (``workload.pools.1.rate=12``)."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"{flag} {item!r}: expected section.key=value")
        path, _, value = item.partition("=")
        keys = path.strip().split(".")
        if not all(keys):
            raise ValueError(f"{flag} {item!r}: empty key in {path.strip()!r}")
        import yaml  # only overrides and files need it (``files.read_structured``)

        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ValueError(f"{flag} {item!r}: the value is not valid YAML ({exc})") from None
        node: Any = raw
        for depth, k in enumerate(keys):
            where = ".".join(keys[:depth]) or "the scenario"
            last = depth == len(keys) - 1
            if isinstance(node, list):
                if not k.isdigit() or int(k) >= len(node):
                    raise ValueError(f"{flag} {item!r}: {where} is a list of {len(node)} items; "
                                     f"address one by its index 0-{len(node) - 1}, not {k!r}")
                k = int(k)
            elif not isinstance(node, dict):
                raise ValueError(f"{flag} {item!r}: {where} is a value ({node!r}), not a section")
            if last:
                node[k] = parsed
            else:
                if isinstance(node, dict) and node.get(k) is None:
                    node[k] = {}  # a section left out, or null (a default)
                node = node[k]
    return raw


def parse_scenario(raw: Any, source: str = "scenario", overrides: list[str] | None = None,
                   base_dir: str | Path | None = None, check_fit: bool = True,
                   grid: list[str] | None = None) -> Scenario:
    """Validate a scenario mapping; relative paths in it resolve from ``base_dir`` (the
    scenario file's folder; default: the current directory). ``check_fit``: every configuration
    must fit ``cluster.gpus`` (a sweep checks each point instead, skipping what does not fit).
    ``overrides`` come from ``--set``, ``grid`` from a sweep point's ``--grid`` values; an
    error in a field they set names them."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: a scenario must be a YAML mapping")
    raw = apply_overrides(raw, overrides or [])
    raw = apply_overrides(raw, grid or [], "--grid")
    named = [("--set", o) for o in overrides or []] + [("--grid", g) for g in grid or []]
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    try:
        scenario = Scenario.model_validate(raw, context={"base_dir": base})
    except ValidationError as exc:
        raise ValueError(_format(exc, source, named)) from None
    if check_fit:
        for name in scenario.configurations:
            try:
                split_gpus(name, scenario.cluster.gpus)
            except ValueError as exc:
                raise ValueError(f"{source}: invalid scenario\n  configurations: {exc}") from None
    return scenario


def scenario_path(name_or_path: str | Path) -> Path:
    """A scenario file by path, or a shipped scenario by name (``quickstart``)."""
    from orthrus_sim import data_dir

    path = Path(name_or_path)
    if path.is_dir():
        raise ValueError(f"scenario {path} is a directory; give a scenario file "
                         f"(for example {path / 'quickstart.yaml'})")
    if path.exists():
        return path
    shipped = data_dir("scenarios") / f"{name_or_path}.yaml"
    if path.suffix == "" and shipped.exists():
        return shipped
    names = sorted(p.stem for p in data_dir("scenarios").glob("*.yaml"))
    raise ValueError(f"scenario file {path} does not exist (shipped scenarios: {', '.join(names)})")


def read_scenario(name_or_path: str | Path) -> dict:
    """The raw mapping of a scenario file (validated later, after any overrides)."""
    path = scenario_path(name_or_path)
    raw = read_structured(path, "scenario file", yaml_format=True)
    if not isinstance(raw, dict):
        raise ValueError(f"scenario file {path}: a scenario must be a YAML mapping")
    return raw


def load_scenario(name_or_path: str | Path, overrides: list[str] | None = None) -> Scenario:
    path = scenario_path(name_or_path)
    return parse_scenario(read_scenario(path), str(path), overrides, base_dir=path.parent)


def scenario_dump(scenario: Scenario) -> dict:
    """The scenario as plain data (after defaults, overrides and path resolution)."""
    return scenario.model_dump(mode="json", by_alias=True)
