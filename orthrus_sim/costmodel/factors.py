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
  time per front end (a replica's own, or the cluster's: ``cluster.front_end``): they occupy
  the server, not the device;
* ``kv_scale``: multiplies the KV cache the memory model gives each replica (what an engine
  reserves beside it that the model does not count: CUDA graphs, its profiler's activation
  peak, adapter buffers; it decides how many long generations run at once);
* ``adapter_scale``: multiplies the device time of the generation rows (prefill chunks and
  decodes) of a replica whose engine has the embedding adapter loaded (a unified replica,
  Disagg-PD's prefill GPUs): a LoRA-enabled engine runs its adapter kernels over every row,
  which the calibration's LoRA operators (the adapter's own rows) do not price.

A split's dedicated embedding GPU is a *stock* embedding server, whose own costs only it pays
(what a co-served engine's embeddings do not):

* ``stock_embedding_scale``: multiplies the device time of its batches, on top of
  ``embedding_scale`` (another engine: eager attention, another dtype);
* ``stock_embedding_padding``: the share of its batches' padding it pays: each batch priced as
  its inputs padded to the longest one (1; a padded batch, as a transformers-based server
  forms it) or as the inputs alone (0, vLLM's pooling runner, which flattens them);
* ``stock_embedding_overhead_s``: seconds per embedding request in its front end, on top of
  ``embedding_overhead_s`` (its API path).

With every factor neutral the cost model is the calibration's, unchanged (the simulator does
not even wrap it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from orthrus_sim.costmodel.shape import BatchShape


@dataclass(frozen=True)
class CostFactors:
    embedding_scale: float = 1.0
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    overlap: float = 1.0
    embedding_overhead_s: float = 0.0
    generation_overhead_s: float = 0.0
    adapter_scale: float = 1.0
    kv_scale: float = 1.0
    stock_embedding_scale: float = 1.0
    stock_embedding_padding: float = 0.0
    stock_embedding_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            low = 1e-9 if f.name.endswith("_scale") else 0.0
            if not value >= low:  # NaN fails too
                raise ValueError(f"cost factor {f.name} must be >= {low:g}, got {value!r}")
        if self.stock_embedding_padding > 1:
            raise ValueError(f"cost factor stock_embedding_padding is a share of the padding, "
                             f"in [0, 1]; got {self.stock_embedding_padding!r}")

    @property
    def device_neutral(self) -> bool:
        """No change to iteration times (overheads may still be set)."""
        return (self.embedding_scale, self.prefill_scale, self.decode_scale, self.overlap,
                self.adapter_scale, self.stock_embedding_scale) == (1.0,) * 6

    @property
    def neutral(self) -> bool:
        return self == CostFactors()

    def seen_by(self, stock: bool, adapter: bool) -> CostFactors:
        """The factors as an arrangement of replicas pays them: the stock embedding server's
        terms only where one serves (``stock``), ``adapter_scale`` only where an engine has the
        adapter loaded; the others neutral. Simulating either gives the same result."""
        out = self
        if not stock:
            out = replace(out, stock_embedding_scale=1.0, stock_embedding_padding=0.0,
                          stock_embedding_overhead_s=0.0)
        if not adapter:
            out = replace(out, adapter_scale=1.0)
        return out

    def overhead_s(self, kind: str, stock: bool = False) -> float:
        """Seconds outside the forward pass of one request of ``kind`` (``embedding`` or
        ``generation``); ``stock``: an embedding bound for a stock embedding server."""
        if kind != "embedding":
            return self.generation_overhead_s
        return self.embedding_overhead_s + (self.stock_embedding_overhead_s if stock else 0.0)

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


def padded(shape: BatchShape, longest: int, share: float) -> BatchShape:
    """A batch of whole embedding inputs (a stock server's) priced as padded: ``share`` of the
    way from its inputs to every row as long as ``longest`` (tokens, and the causal pairs of
    its attention; the adapter's rows, which a stock server has none of, stay)."""
    rows = shape.num_seqs
    full_tokens, full_pairs = rows * longest, rows * longest * (longest + 1) / 2
    tokens = round(shape.tokens + share * (full_tokens - shape.tokens))
    return BatchShape(tokens=tokens, num_seqs=rows, chunk_tokens=tokens,
                      chunk_pairs=shape.chunk_pairs + share * (full_pairs - shape.chunk_pairs),
                      chunk_kv=tokens, lora_rows=shape.lora_rows, pooled_rows=tokens)


class FactoredCostModel:
    """A cost model with ``CostFactors`` applied to its iteration times; work (FLOPs, bytes)
    is the wrapped model's: the factors change how long the work takes, not what it is.
    ``stock``: the model of a stock embedding server (its own scale on top)."""

    def __init__(self, base, factors: CostFactors, stock: bool = False) -> None:
        self.base = base
        self.factors = factors
        self.hardware, self.model = base.hardware, base.model
        self.coefficients, self.lora = base.coefficients, base.lora
        # the generation rows of an engine with the adapter loaded pay its kernels
        adapter = factors.adapter_scale if base.lora is not None else 1.0
        emb = factors.embedding_scale * (factors.stock_embedding_scale if stock else 1.0)
        self._scales = (emb, factors.prefill_scale * adapter, factors.decode_scale * adapter)

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
        s = self._scales[2]
        return [s * t for t in self.base.decode_step_times(shape, steps)]

    def shape_work(self, shape: BatchShape, steps: int = 1) -> tuple[float, float]:
        return self.base.shape_work(shape, steps)

    def adapter_merge_s(self) -> float:
        return self.base.adapter_merge_s()

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        return self.base.breakdown(shape)


def apply_factors(cost, factors: CostFactors | None, stock: bool = False):
    """``cost`` itself when the factors leave iteration times alone, else it wrapped;
    ``stock``: ``cost`` is a stock embedding server's (a split's embedding GPU)."""
    if factors is None or factors.seen_by(stock, cost.lora is not None).device_neutral:
        return cost
    return FactoredCostModel(cost, factors, stock)
