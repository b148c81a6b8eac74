"""Cost factors: a few named corrections on top of a calibration's roofline, fitted to what a
deployment measured (``orthrus-sim fit``), each neutral by default.

A profile of an engine (``orthrus-real calibrate``) sees whole iterations; a deployment's
throughput and latency also depend on costs the profile never sees (a slower embedding path,
tokenisation, HTTP). The factors say how the fitted simulation differs from the calibration's:

* ``embedding_scale``, ``prefill_scale``, ``decode_scale``: multiply the device time of the
  embedding chunks, generation prefill chunks and decodes of an iteration (each kind's part
  priced alone by the calibration's cost model);
* ``overlap``: how much of the co-batching saving the roofline predicts for a mixed iteration
  (the parts priced alone, summed, minus the whole iteration priced at once) is realised: 0 =
  none (a mixed iteration costs the sum of its parts), 1 = the calibration's roofline, 2 =
  twice its saving; never less than the dearest part;
* ``embedding_overhead_s``, ``generation_overhead_s``: seconds each request of that kind spends
  in the server outside the forward pass (tokenisation, pooling output, HTTP), one request at a
  time per replica: they occupy the server, not the device.

With every factor neutral the cost model is the calibration's, unchanged (the simulator does
not even wrap it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from orthrus_sim.costmodel.shape import BatchShape


@dataclass(frozen=True)
class CostFactors:
    embedding_scale: float = 1.0
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    overlap: float = 1.0
    embedding_overhead_s: float = 0.0
    generation_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0.0 if f.name == "overlap" or f.name.endswith("_overhead_s") else 1e-9
            if not value >= low:  # NaN fails too
                raise ValueError(f"cost factor {f.name} must be >= {low:g}, got {value!r}")

    @property
    def device_neutral(self) -> bool:
        """No change to iteration times (overheads may still be set)."""
        return (self.embedding_scale, self.prefill_scale, self.decode_scale, self.overlap) == (1.0,) * 4

    @property
    def neutral(self) -> bool:
        return self == CostFactors()

    def overhead_s(self, kind: str) -> float:
        """Seconds outside the forward pass of one request of ``kind`` (``embedding`` or
        ``generation``)."""
        return self.embedding_overhead_s if kind == "embedding" else self.generation_overhead_s

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def split_shape(shape: BatchShape) -> tuple[BatchShape, BatchShape, BatchShape]:
    """The embedding, prefill and decode parts of an iteration, each as a batch of its own.

    Chunk attention and sequence counts are shared by embedding and prefill chunks in a
    ``BatchShape``; they are split in proportion to each kind's chunk tokens (a mixed batch
    only: a batch of one kind is priced whole).
    """
    emb_tokens = shape.pooled_rows
    pre_tokens = shape.chunk_tokens - emb_tokens
    frac = emb_tokens / shape.chunk_tokens if shape.chunk_tokens else 0.0
    chunk_seqs = shape.num_seqs - shape.decodes
    emb_seqs = min(chunk_seqs, max(1, round(chunk_seqs * frac))) if emb_tokens else 0
    pre_seqs = chunk_seqs - emb_seqs
    emb = BatchShape(tokens=emb_tokens, num_seqs=emb_seqs, chunk_tokens=emb_tokens,
                     chunk_pairs=shape.chunk_pairs * frac, chunk_kv=round(shape.chunk_kv * frac),
                     lora_rows=shape.lora_rows, pooled_rows=emb_tokens)
    pre = BatchShape(tokens=pre_tokens, num_seqs=pre_seqs, chunk_tokens=pre_tokens,
                     chunk_pairs=shape.chunk_pairs - emb.chunk_pairs,
                     chunk_kv=shape.chunk_kv - emb.chunk_kv,
                     sample_rows=shape.sample_rows - shape.decodes)
    dec = BatchShape(tokens=shape.decodes, num_seqs=shape.decodes, decodes=shape.decodes,
                     decode_kv=shape.decode_kv, sample_rows=shape.decodes)
    return emb, pre, dec


class FactoredCostModel:
    """A cost model with ``CostFactors`` applied to its iteration times; work (FLOPs, bytes)
    is the wrapped model's: the factors change how long the work takes, not what it is."""

    def __init__(self, base, factors: CostFactors) -> None:
        self.base = base
        self.factors = factors
        self.hardware, self.model = base.hardware, base.model
        self.coefficients, self.lora = base.coefficients, base.lora
        self._scales = (factors.embedding_scale, factors.prefill_scale, factors.decode_scale)

    def shape_time(self, shape: BatchShape) -> float:
        if shape.num_seqs == 0:
            return 0.0
        base = self.base
        whole = base.shape_time(shape)
        parts = split_shape(shape)
        present = [i for i, p in enumerate(parts) if p.num_seqs]
        if len(present) == 1:
            return self._scales[present[0]] * whole
        alone = [base.shape_time(parts[i]) for i in present]
        scaled = [self._scales[i] * t for i, t in zip(present, alone)]
        total, scaled_total = sum(alone), sum(scaled)
        saving = max(0.0, total - whole) * (scaled_total / total if total else 1.0)
        return max(max(scaled), scaled_total - self.factors.overlap * saving)

    def iteration_time(self, batch) -> float:
        return self.shape_time(BatchShape.from_batch(batch, adapter=self.lora is not None))

    def decode_step_times(self, shape: BatchShape, steps: int) -> list[float]:
        s = self.factors.decode_scale
        return [s * t for t in self.base.decode_step_times(shape, steps)]

    def shape_work(self, shape: BatchShape, steps: int = 1) -> tuple[float, float]:
        return self.base.shape_work(shape, steps)

    def adapter_merge_s(self) -> float:
        return self.base.adapter_merge_s()

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        return self.base.breakdown(shape)


def apply_factors(cost, factors: CostFactors | None):
    """``cost`` itself when the factors leave iteration times alone, else it wrapped."""
    if factors is None or factors.device_neutral:
        return cost
    return FactoredCostModel(cost, factors)
