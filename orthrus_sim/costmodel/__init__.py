"""Cost model: how long one iteration over a batch unit takes on a device.

The simulator-facing API, in full::

    from orthrus_sim.costmodel import CostModel, get_hardware, get_model, LoRASpec
    from orthrus_sim.costmodel import kv_cache_blocks, load_calibration

    hw = get_hardware("a100-40gb")              # catalogue name (ValueError lists the known ones)
    model = get_model("mistral-7b-v0.1")        # catalogue name or a path to a config.json
    coeffs = load_calibration("calibration/a100-40gb.json").to_coefficients()
    cost = CostModel(hw, model, coeffs, lora=LoRASpec(rank=16))   # lora=None: no adapter
    seconds = cost.iteration_time(batch_unit)   # one forward pass + emit, in seconds
    parts = cost.breakdown(BatchShape.from_batch(batch_unit))     # seconds per operator
    blocks = kv_cache_blocks(hw, model, block_size=16, token_budget=4096, max_num_seqs=256)

Each operator's time is the larger of its compute time (FLOPs / peak / compute_eff) and its
memory time (bytes / bandwidth / memory_eff), rounded off at the ridge point (see ``OpCoeffs``),
plus a fixed per-iteration and per-sequence overhead. Weights are read once per iteration for
all tokens, so decode-heavy batches are memory-bound and chunk-heavy ones compute-bound; a
mixed batch fills both. Tensor and pipeline parallelism are out of scope: one replica runs on
one device.
"""

from orthrus_sim.costmodel.calibration import (
    CalibrationFile,
    OperatorSample,
    fit_iterations,
    fit_operator,
    load_calibration,
    save_calibration,
)
from orthrus_sim.costmodel.coefficients import Coefficients, OpCoeffs
from orthrus_sim.costmodel.cost import CostModel, iteration_work
from orthrus_sim.costmodel.hardware import HARDWARE, Hardware, get_hardware
from orthrus_sim.costmodel.memory import kv_cache_blocks
from orthrus_sim.costmodel.model import (
    MODEL_CONFIGS,
    LoRASpec,
    ModelSpec,
    get_model,
    spec_from_config,
)
from orthrus_sim.costmodel.operators import OPERATORS, operator_work
from orthrus_sim.costmodel.predictor import CostModelPredictor, calibrated_predictor
from orthrus_sim.costmodel.shape import BatchShape

__all__ = [
    "HARDWARE", "MODEL_CONFIGS", "OPERATORS", "BatchShape", "CalibrationFile", "Coefficients",
    "CostModel", "CostModelPredictor", "Hardware", "LoRASpec", "ModelSpec", "OpCoeffs",
    "OperatorSample", "calibrated_predictor", "fit_iterations", "fit_operator", "get_hardware",
    "get_model", "iteration_work", "kv_cache_blocks", "load_calibration", "operator_work",
    "save_calibration", "spec_from_config",
]
