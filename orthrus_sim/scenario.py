"""Scenario files: YAML validated with pydantic; an error names the field path and the problem."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orthrus_sim.engine.registry import resolve_policy
from orthrus_sim.files import read_structured
from orthrus_sim.sim.distributions import LengthDist, Uniform, fixed


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class EmbeddingSection(Strict):
    lora_rank: int | None = Field(default=16, ge=1, description="null: no adapter")
    lora_targets: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                               "down_proj"]
    pooling: Literal["mean", "weighted-mean", "cls", "last"] = "mean"
    bidirectional: bool = Field(default=False, description="a bidirectional embedder cannot be chunked")
    model: str | None = Field(default=None, description="dedicated embedding model (default: the base)")


class ClusterSection(Strict):
    gpus: int = Field(default=1, ge=1)
    router: Literal["round-robin", "least-work"] = "round-robin"
    memory_utilization: float = Field(default=0.9, gt=0, le=1)


class SchedulerSection(Strict):
    policy: str | None = Field(default=None, description="policy for the 'orthrus' configuration")
    token_budget: int = Field(default=4096, ge=1)
    chunk_size: int | None = Field(default=512, ge=1)
    max_num_seqs: int = Field(default=256, ge=1)
    block_size: int = Field(default=16, ge=1)
    num_blocks: int | None = Field(default=None, ge=1, description="default: from the memory model")
    waiting_work: Literal["prompt", "prompt+output"] = "prompt"
    generation_token_budget: int | None = Field(default=None, ge=1,
                                                description="budget of dedicated generation replicas")

    @model_validator(mode="after")
    def _chunk_fits(self):
        if self.chunk_size is not None and self.chunk_size > self.token_budget:
            raise ValueError(f"chunk_size ({self.chunk_size}) is larger than token_budget "
                             f"({self.token_budget})")
        return self

    @field_validator("policy")
    @classmethod
    def _policy_imports(cls, v):
        if v is not None:
            resolve_policy(v)
        return v


class Arrival(Strict):
    process: Literal["closed-loop", "poisson", "gamma", "burst"] = "closed-loop"
    clients: int = Field(default=64, ge=1, description="closed-loop clients")
    think_time_s: float = Field(default=0.0, ge=0)
    rate: float | None = Field(default=None, gt=0, description="open-loop arrivals per second")
    cv: float = Field(default=1.0, gt=0, description="gamma: coefficient of variation")

    @model_validator(mode="after")
    def _rate(self):
        if self.process in ("poisson", "gamma") and self.rate is None:
            raise ValueError(f"process {self.process!r} needs 'rate' (arrivals per second)")
        return self


class BurstGroup(Strict):
    kind: Literal["embedding", "generation"]
    count: int = Field(ge=1)


class Phase(Strict):
    """A stretch of the workload with its own mix: it lasts ``duration_s`` or ``requests``
    units of work (requests, or workflows), whichever the phase gives."""

    duration_s: float | None = Field(default=None, gt=0)
    requests: int | None = Field(default=None, ge=1)
    generation_share: float = Field(ge=0, le=1)

    @model_validator(mode="after")
    def _one_length(self):
        if (self.duration_s is None) == (self.requests is None):
            raise ValueError("give exactly one of duration_s or requests")
        return self


class IterRetGen(Strict):
    iterations: int = Field(default=2, ge=1)
    docs_per_query: LengthDist = Field(
        default_factory=lambda: Uniform(dist="uniform", low=1, high=10))
    doc_tokens: LengthDist = Field(default_factory=lambda: fixed(100))
    question_tokens: LengthDist = Field(default_factory=lambda: fixed(32))
    output_tokens: LengthDist = Field(default_factory=lambda: fixed(256))
    retrieval_latency_s: float = Field(default=0.0, ge=0)
    max_prompt_tokens: int | None = Field(default=None, ge=1)


class Workload(Strict):
    kind: Literal["synthetic", "iter-retgen", "trace"] = "synthetic"
    arrival: Arrival = Field(default_factory=Arrival)
    generation_share: float = Field(default=0.5, ge=0, le=1)
    embedding_input: LengthDist = Field(default_factory=lambda: fixed(128))
    generation_prompt: LengthDist = Field(default_factory=lambda: fixed(128))
    generation_output: LengthDist = Field(default_factory=lambda: fixed(512))
    burst: list[BurstGroup] = []
    phases: list[Phase] = []
    iter_retgen: IterRetGen = Field(default_factory=IterRetGen)
    trace: str | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.kind == "trace" and not self.trace:
            raise ValueError("kind 'trace' needs 'trace: path/to/file.jsonl|csv'")
        if self.trace and not Path(self.trace).exists():
            raise ValueError(f"trace file {self.trace} does not exist")
        if self.arrival.process == "burst" and self.kind == "synthetic" and not self.burst:
            raise ValueError("arrival.process 'burst' needs a 'burst' list of {kind, count}")
        by_time = [p.duration_s is not None for p in self.phases]
        if any(by_time) and not all(by_time):
            raise ValueError("phases: give every phase a duration_s, or every phase a requests count")
        return self


CONFIG_RE = re.compile(
    r"^(orthrus|unified-hetero|unified-homo|dedicated(?:-(\d+):(\d+))?|disagg-pd(?:-(\d+):(\d+))?|unified:.+)$"
)


class Scenario(Strict):
    name: str
    seed: int = 0
    duration_s: float | None = Field(default=None, gt=0)
    num_requests: int | None = Field(default=None, ge=1)
    warmup_s: float = Field(default=0.0, ge=0, description="requests finishing earlier are not counted")
    hardware: str = "a100-40gb"
    model: str = "mistral-7b-v0.1"
    embedding: EmbeddingSection = Field(default_factory=EmbeddingSection)
    calibration: str | None = None
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    workload: Workload = Field(default_factory=Workload)
    configurations: list[str] = ["orthrus"]
    max_sim_time_s: float = Field(default=36_000.0, gt=0)
    timeline_interval_s: float = Field(default=1.0, gt=0)

    @field_validator("configurations")
    @classmethod
    def _configs(cls, v):
        if not v:
            raise ValueError("list at least one configuration")
        for name in v:
            if not CONFIG_RE.match(name):
                raise ValueError(
                    f"unknown configuration {name!r}; use dedicated[-N:M], disagg-pd[-P:D], "
                    "unified-homo, unified-hetero, orthrus, or unified:<policy name or module:Class>"
                )
            if name.startswith("unified:"):
                resolve_policy(name.split(":", 1)[1])
        return v

    @model_validator(mode="after")
    def _cross_checks(self):
        from orthrus_sim.costmodel import get_hardware, get_model

        get_hardware(self.hardware)
        get_model(self.model)
        if self.embedding.model:
            get_model(self.embedding.model)
        if self.calibration and not Path(self.calibration).exists():
            raise ValueError(f"calibration: file {self.calibration} does not exist")
        w = self.workload
        counted = bool(w.phases) and w.phases[0].requests is not None
        open_ended = w.kind != "trace" and w.arrival.process != "burst" and not counted
        if open_ended and self.duration_s is None and self.num_requests is None:
            raise ValueError("give duration_s or num_requests: the workload never ends by itself")
        if w.phases and w.phases[0].duration_s is not None and self.duration_s is None:
            self.duration_s = sum(p.duration_s for p in w.phases)
        for name in self.configurations:
            split_gpus(name, self.cluster.gpus)
        if self.embedding.bidirectional and self.scheduler.chunk_size is not None:
            raise ValueError("embedding.bidirectional: a bidirectional embedder cannot be chunked "
                             "exactly; set scheduler.chunk_size: null (atomic embeddings)")
        return self


def split_gpus(name: str, gpus: int) -> tuple[int, int] | None:
    """GPUs of the two pools of a split configuration (embedding:generation for dedicated,
    prefill:decode for disagg-pd); None for unified ones. Bare ``dedicated`` gives a quarter of
    the GPUs (at least one) to embeddings, bare ``disagg-pd`` half to prefill."""
    m = CONFIG_RE.match(name)
    if name.startswith("dedicated"):
        first, second = m.group(2), m.group(3)
        auto = max(1, gpus // 4)
    elif name.startswith("disagg-pd"):
        first, second = m.group(4), m.group(5)
        auto = max(1, gpus // 2)
    else:
        return None
    a, b = (int(first), int(second)) if first is not None else (auto, gpus - auto)
    if a + b != gpus:
        raise ValueError(f"configuration {name!r} uses {a + b} GPUs but cluster.gpus is {gpus}")
    if first is None and b < 1:
        raise ValueError(f"configuration {name!r} needs at least 2 GPUs (cluster.gpus is {gpus})")
    if name.startswith("disagg-pd") and (a < 1 or b < 1):
        raise ValueError(f"configuration {name!r} needs at least one prefill and one decode GPU")
    return a, b


def _format(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid scenario"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"  {loc or '(top level)'}: {msg}")
    return "\n".join(lines)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """``section.key=value`` overrides on a copy; the value is parsed as YAML (lists, null)."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected section.key=value")
        path, _, value = item.partition("=")
        keys = path.strip().split(".")
        node = raw
        for k in keys[:-1]:
            if not isinstance(node.get(k, {}), dict):
                raise ValueError(f"--set {item!r}: {k!r} is not a section")
            node = node.setdefault(k, {})
        node[keys[-1]] = yaml.safe_load(value)
    return raw


def parse_scenario(raw: Any, source: str = "scenario", overrides: list[str] | None = None) -> Scenario:
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: a scenario must be a YAML mapping")
    raw = apply_overrides(raw, overrides or [])
    try:
        return Scenario.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(_format(exc, source)) from None


def read_scenario(path: str | Path) -> dict:
    """The raw mapping of a scenario file (validated later, after any overrides)."""
    raw = read_structured(path, "scenario file", yaml_format=True)
    if not isinstance(raw, dict):
        raise ValueError(f"scenario file {path}: a scenario must be a YAML mapping")
    return raw


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    return parse_scenario(read_scenario(path), str(path), overrides)
