"""Iteration time of a batch unit on one device: the simulator's one question."""

from __future__ import annotations

from orthrus_sim.costmodel.coefficients import Coefficients
from orthrus_sim.costmodel.hardware import Hardware
from orthrus_sim.costmodel.model import LoRASpec, ModelSpec
from orthrus_sim.costmodel.operators import (
    PER_LAYER,
    decode_attention_rates,
    decode_attention_work_at,
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
        self._token_cache: dict[int, float] = {}
        self._work_cache: dict[int, tuple[float, float]] = {}
        self._base_cache: dict[tuple, float] = {}
        self._base_work_cache: dict[tuple, tuple[float, float]] = {}
        self._attention_rates = decode_attention_rates(model)

    def _op_time(self, name: str, flops: float, bytes_: float) -> float:
        if flops == 0.0 and bytes_ == 0.0:
            return 0.0
        return self.coefficients.ops[name].time(flops, bytes_, self.hardware.peak_flops,
                                                self.hardware.mem_bw)

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
        """Seconds of one iteration: everything but the decodes' attention (``_base_time``),
        plus that attention; a decode run (``decode_step_times``) prices its steps with the
        very same two terms, so stepping and runs give identical floats."""
        if shape.num_seqs == 0:
            return 0.0
        return self._base_time(shape) + self._decode_attention_time(shape.decode_kv, shape.decodes)

    def _base_time(self, shape: BatchShape) -> float:
        key = _base_key(shape)
        cached = self._base_cache.get(key)
        if cached is not None:
            return cached
        fixed = self._token_cache.get(shape.tokens)
        if fixed is None:
            fixed = sum(self._whole_model(token_work(self.model, shape.tokens)).values())
            self._token_cache[shape.tokens] = fixed
        work = variable_work(self.model, shape, self.lora)
        del work["attn_decode"]
        rest = sum(self._whole_model(work).values())
        c = self.coefficients
        base = fixed + rest + c.iteration_overhead_s + c.per_seq_overhead_s * shape.num_seqs
        _bounded_put(self._base_cache, key, base)
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
        model = self.model
        key = _base_key(shape)
        base = self._base_work_cache.get(key)
        if base is None:  # everything but the decodes' attention, as _base_time
            fixed = self._work_cache.get(shape.tokens)
            if fixed is None:
                work = token_work(model, shape.tokens)
                fixed = (_layer_sum(model, work, 0), _layer_sum(model, work, 1))
                self._work_cache[shape.tokens] = fixed
            work = variable_work(model, shape, self.lora)
            del work["attn_decode"]
            base = (fixed[0] + _layer_sum(model, work, 0), fixed[1] + _layer_sum(model, work, 1))
            _bounded_put(self._base_work_cache, key, base)
        per_model = PER_LAYER["attn_decode"] * model.num_layers
        attn = decode_attention_work_at(self._attention_rates, shape.decode_kv, shape.decodes)
        flops = base[0] + attn[0] * per_model
        bytes_ = base[1] + attn[1] * per_model
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
        base = self._base_time(shape)  # does not depend on the decodes' contexts
        n, kv = shape.decodes, shape.decode_kv
        if not n:
            return [base] * steps
        # _decode_attention_time step by step, in bulk (the same operations: the same floats)
        model, hw = self.model, self.hardware
        flops_per_kv, b, kv_row, q_row = self._attention_rates
        q_elems = q_row * n
        times = self.coefficients.ops["attn_decode"].times(
            [(flops_per_kv * rows, b * (kv_row * rows + q_elems))
             for rows in range(kv, kv + n * steps, n)], hw.peak_flops, hw.mem_bw)
        reps, layers = PER_LAYER["attn_decode"], model.num_layers
        return [base + t * reps * layers for t in times]


# shapes remembered per cost model: past it the cache starts afresh (memory stays bounded)
BASE_CACHE_SIZE = 1 << 16


def _base_key(shape: BatchShape) -> tuple:
    """Every count of ``shape`` but ``decode_kv``: what the cost besides the decodes'
    attention depends on."""
    return (shape.tokens, shape.num_seqs, shape.decodes, shape.chunk_tokens, shape.chunk_pairs,
            shape.chunk_kv, shape.lora_rows, shape.sample_rows, shape.pooled_rows)


def _bounded_put(cache: dict, key, value) -> None:
    if len(cache) >= BASE_CACHE_SIZE:
        cache.clear()
    cache[key] = value


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
