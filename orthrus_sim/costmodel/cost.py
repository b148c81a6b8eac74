"""Iteration time of a batch unit on one device: the simulator's one question."""

from __future__ import annotations

from orthrus_sim.costmodel.coefficients import Coefficients
from orthrus_sim.costmodel.hardware import Hardware
from orthrus_sim.costmodel.model import LoRASpec, ModelSpec
from orthrus_sim.costmodel.operators import (
    PER_LAYER,
    decode_attention_rates,
    decode_attention_work_at,
    decode_attention_work_steps,
    lora_shapes,
    operator_work,
    token_work,
    variable_work,
)
from orthrus_sim.costmodel.shape import BatchShape
from orthrus_sim.engine.batch import BatchUnit


class CostModel:
    """Roofline cost of one iteration, operator by operator.

    ``iteration_time(batch)`` is what the simulator calls; ``breakdown(shape)`` gives each
    operator's seconds (whole model, all layers) for reports and tests. Operators whose work
    depends only on the number of tokens are cached by token count, and everything but the
    decodes' attention by the shape's other counts (an iteration's make-up repeats: the same
    decodes beside the same prompt chunk), which keeps the simulator's hot path short.
    """

    def __init__(self, hardware: Hardware, model: ModelSpec, coefficients: Coefficients | None = None,
                 lora: LoRASpec | None = None) -> None:
        self.hardware = hardware
        self.model = model
        self.coefficients = coefficients or Coefficients()
        self.lora = lora
        # seconds, FLOPs and bytes: of the operators that depend only on the token count (by
        # that count), and of everything but the decodes' attention (by all its counts but ``decode_kv``)
        self._token_cache: dict[int, tuple[float, float, float]] = {}
        self._base_cache: dict[tuple, tuple[float, float, float]] = {}
        self._attention_rates = decode_attention_rates(model)
        self._attention_per_model = PER_LAYER["attn_decode"] * model.num_layers  # layers' repeats

    def adapter_merge_s(self) -> float:
        """Seconds to merge the embedding adapter into the weights it targets (or take it out
        again): every targeted weight read and written once (``W += B A``; its FLOPs are a
        rank's worth per weight, negligible)."""
        if self.lora is None:
            return 0.0
        weights = sum(n_in * n_out for n_in, n_out in lora_shapes(self.model, self.lora))
        return 2 * weights * self.model.num_layers * self.model.dtype_bytes / self.hardware.mem_bw

    def _op_time(self, name: str, flops: float, bytes_: float) -> float:
        if flops == 0.0 and bytes_ == 0.0:
            return 0.0
        hw = self.hardware
        return self.coefficients.ops[name].time(flops, bytes_, hw.peak_flops, hw.mem_bw,
                                                hw.cache_bytes)

    def _whole_model(self, work: dict[str, tuple[float, float]]) -> dict[str, float]:
        layers = self.model.num_layers
        out = {}
        for name, (flops, bytes_) in work.items():
            reps = PER_LAYER.get(name, 0)
            t = self._op_time(name, flops, bytes_)
            out[name] = t * reps * layers if reps else t
        return out

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        """Seconds per operator over the whole model, plus the two overheads."""
        out = self._whole_model(operator_work(self.model, shape, self.lora))
        c = self.coefficients
        out["iteration_overhead"] = c.iteration_overhead_s if shape.num_seqs else 0.0
        out["seq_overhead"] = c.per_seq_overhead_s * shape.num_seqs
        return out

    def shape_time(self, shape: BatchShape) -> float:
        """Seconds of one iteration: everything but the decodes' attention (``_base``),
        plus that attention; a decode run (``decode_step_times``) prices its steps with the
        very same two terms, so stepping and runs give identical floats."""
        if shape.num_seqs == 0:
            return 0.0
        return self._base(shape)[0] + self._decode_attention_time(shape.decode_kv, shape.decodes)

    def _base(self, shape: BatchShape) -> tuple[float, float, float]:
        """Seconds, FLOPs and bytes of everything in one iteration but the decodes' attention
        (a shape's time and work are asked for together: one lookup, one pass on a miss)."""
        # every count of ``shape`` but ``decode_kv``: what the cost besides the decodes'
        # attention depends on (built here, not in a function: ~50,000 lookups a run)
        key = (shape.tokens, shape.num_seqs, shape.decodes, shape.chunk_tokens, shape.chunk_pairs,
               shape.chunk_kv, shape.lora_rows, shape.sample_rows, shape.pooled_rows)
        cached = self._base_cache.get(key)
        if cached is not None:
            return cached
        model = self.model
        fixed = self._token_cache.get(shape.tokens)
        if fixed is None:
            work = token_work(model, shape.tokens)
            fixed = (sum(self._whole_model(work).values()), _layer_sum(model, work, 0),
                     _layer_sum(model, work, 1))
            self._token_cache[shape.tokens] = fixed
        work = variable_work(model, shape, self.lora)
        del work["attn_decode"]
        c = self.coefficients
        seconds = (fixed[0] + sum(self._whole_model(work).values()) + c.iteration_overhead_s
                   + c.per_seq_overhead_s * shape.num_seqs)
        base = (seconds, fixed[1] + _layer_sum(model, work, 0), fixed[2] + _layer_sum(model, work, 1))
        if len(self._base_cache) >= BASE_CACHE_SIZE:
            self._base_cache.clear()  # memory stays bounded
        self._base_cache[key] = base
        return base

    def _decode_attention_time(self, decode_kv: int, decodes: int) -> float:
        if not decodes:
            return 0.0
        flops, bytes_ = decode_attention_work_at(self._attention_rates, decode_kv, decodes)
        return self._op_time("attn_decode", flops, bytes_) * PER_LAYER["attn_decode"] * self.model.num_layers

    def iteration_time(self, batch: BatchUnit) -> float:
        """Seconds one forward pass (and its emit stage) over ``batch`` takes."""
        return self.shape_time(BatchShape.from_batch(batch, adapter=self.lora is not None))

    def shape_work(self, shape: BatchShape, steps: int = 1) -> tuple[float, float]:
        """FLOPs and bytes of one iteration, in one pass over the operators; with ``steps``,
        of that many decode iterations from ``shape`` (each decode's context one token longer
        a step: only the decodes' attention grows, linearly, so the sum has a closed form)."""
        if shape.num_seqs == 0:
            return 0.0, 0.0
        _, base_flops, base_bytes = self._base(shape)
        per_model = self._attention_per_model
        attn = decode_attention_work_at(self._attention_rates, shape.decode_kv, shape.decodes)
        flops = base_flops + attn[0] * per_model
        bytes_ = base_bytes + attn[1] * per_model
        if steps == 1:
            return flops, bytes_
        # sum over k < steps of the attention work of k * decodes more context tokens
        grown = decode_attention_work_at(self._attention_rates,
                                         shape.decodes * (steps * (steps - 1) // 2), 0)
        return flops * steps + grown[0] * per_model, bytes_ * steps + grown[1] * per_model

    def decode_step_times(self, shape: BatchShape, steps: int) -> list[float]:
        """Times of ``steps`` consecutive all-decode iterations starting from ``shape``: each
        step every decode's context grows by one token; nothing else changes."""
        if shape.num_seqs == 0:
            return [0.0] * steps
        base = self._base(shape)[0]  # does not depend on the decodes' contexts
        n, kv = shape.decodes, shape.decode_kv
        if not n:
            return [base] * steps
        # _decode_attention_time step by step, in bulk (the same operations: the same floats)
        hw = self.hardware
        times = self.coefficients.ops["attn_decode"].times(
            decode_attention_work_steps(self._attention_rates, kv, n, steps),
            hw.peak_flops, hw.mem_bw, hw.cache_bytes)
        reps, layers = PER_LAYER["attn_decode"], self.model.num_layers
        return [base + t * reps * layers for t in times]


# shapes remembered per cost model: past it the cache starts afresh (memory stays bounded)
BASE_CACHE_SIZE = 1 << 16


def _layer_sum(model: ModelSpec, work: dict[str, tuple[float, float]], index: int) -> float:
    """Whole-model FLOPs (``index`` 0) or bytes (1) of per-operator work."""
    layers = model.num_layers
    total = 0.0
    for name, pair in work.items():
        reps = PER_LAYER.get(name, 0)
        total += pair[index] * (reps * layers if reps else 1)
    return total


def iteration_work(model: ModelSpec, shape: BatchShape, lora: LoRASpec | None = None
                   ) -> tuple[float, float]:
    """FLOPs and bytes of one iteration over ``shape``, whatever the hardware (a real engine
    counts its model FLOPs with this)."""
    if shape.num_seqs == 0:
        return 0.0, 0.0
    work = operator_work(model, shape, lora)
    return _layer_sum(model, work, 0), _layer_sum(model, work, 1)
