"""The cost model as the core's iteration-time predictor (``tpot_target_s``)."""

from __future__ import annotations

import copy

from orthrus_sim.costmodel.cost import CostModel
from orthrus_sim.costmodel.shape import BatchShape
from orthrus_sim.engine.batch import BatchItem, BatchUnit


class CostModelPredictor:
    """``predict(batch, extra)`` by ``CostModel.shape_time``.

    A policy asks several times while it fills one batch (a binary search per chunk), and only
    appends items between the calls, so the batch's shape is kept and extended, not rebuilt.
    """

    def __init__(self, cost) -> None:
        """``cost``: a ``CostModel`` (or one wrapped with fitted factors): ``shape_time`` and
        ``lora``."""
        self.cost = cost
        self.adapter = cost.lora is not None
        self._batch: BatchUnit | None = None
        self._seen = 0
        self._shape = BatchShape()
        self._cohort = self._kv = 0  # the cohort segment counted so far

    def predict(self, batch: BatchUnit, extra: BatchItem | None = None) -> float:
        items = batch.items
        if batch is not self._batch or len(items) < self._seen:
            self._batch, self._seen, self._shape = batch, 0, BatchShape()
            self._cohort = self._kv = 0
        shape, adapter = self._shape, self.adapter
        if batch.cohort_decodes != self._cohort:  # the decode cohort's segment (engine/cohort.py)
            shape.add_decodes(batch.cohort_decodes - self._cohort, batch.cohort_kv - self._kv)
            self._cohort, self._kv = batch.cohort_decodes, batch.cohort_kv
        for it in items[self._seen:]:
            shape.add_item(it.kind, it.num_tokens, it.start, it.samples, adapter)
        self._seen = len(items)
        if extra is not None:
            shape = copy.copy(shape)
            shape.add_item(extra.kind, extra.num_tokens, extra.start, extra.samples, adapter)
        return self.cost.shape_time(shape)


def calibrated_predictor(calibration: str, model: str, lora_rank: int | None = None
                         ) -> CostModelPredictor:
    """The predictor a real engine hands its policy: the cost model that ``orthrus-real
    calibrate`` fitted (``calibration``: a file or shipped name) for ``model`` (a checkpoint
    directory or catalogue name) and its embedding adapter's rank."""
    from orthrus_sim.costmodel.calibration import load_calibration
    from orthrus_sim.costmodel.factors import apply_factors
    from orthrus_sim.costmodel.hardware import get_hardware
    from orthrus_sim.costmodel.model import LoRASpec, get_model

    cal = load_calibration(calibration)
    cost = CostModel(get_hardware(cal.hardware), get_model(model), cal.to_coefficients(),
                     LoRASpec(lora_rank) if lora_rank else None)
    # a calibration fitted by `orthrus-sim fit` predicts with its factors, as the simulator does
    return CostModelPredictor(apply_factors(cost, cal.cost_factors()))
