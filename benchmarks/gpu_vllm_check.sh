#!/usr/bin/env bash
# The one prepared GPU run for the vLLM plug-in (official CUDA wheel), sized for a few minutes:
#   1. install vllm 0.33 and the project without its CPU torch pin (vllm pins its own torch);
#   2. the plug-in's tests (tests/test_vllm_backend.py: embeddings and greedy tokens equal the
#      PyTorch engine's, one step carries both kinds of rows, preemption, serve, calibrate);
#   3. the mix benchmark on a generated ~1B model (TinyLlama-1.1B's shape, bf16): Orthrus and
#      the unified baselines against a generation-only and an embedding-only vLLM engine that
#      share the GPU (40 % of its memory each).
# Output goes to stdout and, when $OUT is set (the device runner), to $OUT/gpu_vllm_check.log.
# Usage: bash benchmarks/gpu_vllm_check.sh [duration_s]
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:-20}
LOG=${OUT:-/tmp}/gpu_vllm_check.log
exec > >(tee "$LOG") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

if python3 -c "import vllm, sys; sys.exit(not vllm.__version__.startswith(('0.32.', '0.33.')))" 2>/dev/null; then
  PY=python3  # a machine with vLLM already installed (no package index needed)
else
  python3 -m venv .gpu-venv  # needs a package index
  PY=.gpu-venv/bin/python
  $PY -m pip install -q --upgrade pip
  $PY -m pip install -q "vllm==0.33.*"
fi
# the project without the [real] extra's torch==2.13.0 (CPU) pin; everything else it needs
$PY -m pip install -q --no-deps -e .
$PY -m pip install -q numpy scipy simpy pydantic pyyaml typer rich matplotlib safetensors \
    tokenizers fastapi uvicorn httpx prometheus_client jinja2 pytest hypothesis
$PY -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"

echo "== plug-in tests =="
$PY -m pytest -m vllm tests/test_vllm_backend.py -p no:warnings -rA || echo "TESTS FAILED"

echo "== mix benchmark (1B model, ${DURATION} s per configuration) =="
$PY -m orthrus_real.cli init-model models/gpu-1b --size 1b --seed 0
$PY -m benchmarks.engine.mix --backend vllm --model models/gpu-1b --streams 16,64 \
    --mixes 5:5,1:9 --duration "$DURATION" --warmup 4
