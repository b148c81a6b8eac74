#!/usr/bin/env bash
# The GPU check of the PyTorch engine, for a bare GPU machine (Python with torch + CUDA,
# transformers, numpy and scipy; no package index), sized to finish in under 8 minutes:
#   1. the project's other dependencies from wheels carried in WHEELS (default: wheels/), into
#      OUT/site (nothing installed system-wide);
#   2. the engine tests on the GPU (tests/test_real_engine.py and tests/test_sampling.py, on
#      DEVICE, fp32, with GPU tolerances);
#   3. the engine against transformers on the same GPU (benchmarks/engine_peers.py, `1b`, bf16);
#   4. benchmarks/engine_mix.py at 64 streams, mixes 5:5 and 1:9;
#   5. orthrus-real calibrate --hardware HARDWARE (default h200), 20 s of mixed load.
# Each step has a time limit and its own log in OUT (default: out/gpu_check); a failing step is
# recorded in OUT/summary.txt and the next one runs.
#
# Prepare the wheels where a package index is reachable, for the GPU machine's Python (3.12 here):
#   pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
#     -d wheels -r benchmarks/gpu_check_wheels.txt
# and carry wheels/ with the checkout. A dry run on a CPU checks the script itself (tiny model,
# short runs): DEVICE=cpu bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
WHEELS=${WHEELS:-wheels}
HARDWARE=${HARDWARE:-$([ "$DEVICE" = cpu ] && echo cpu-2core || echo h200)}
OUTDIR=${OUT:-out/gpu_check}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
PY=${PYTHON:-python3}
SUMMARY="$OUTDIR/summary.txt"
: > "$SUMMARY"

if [ "$DEVICE" = "cpu" ]; then  # the dry run
  SIZE=tiny; DTYPE=float32; DURATION=4; WARMUP=1; STREAMS=4; LOAD=3; REPEATS=1
else
  SIZE=1b; DTYPE=bfloat16; DURATION=10; WARMUP=2; STREAMS=64; LOAD=20; REPEATS=2
fi

step() {  # step NAME LIMIT_S COMMAND...: run, log to OUT/NAME.log, note the outcome
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name =="
  timeout "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
  local rc=$?
  tail -n 30 "$OUTDIR/$name.log"
  echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$SUMMARY"
}

if [ -d "$WHEELS" ]; then
  SITE="$OUTDIR/site"
  mkdir -p "$SITE"
  # numpy, scipy, torch and transformers are the machine's own
  ls "$WHEELS"/*.whl | grep -v -E '/(numpy|scipy|torch|transformers|triton|nvidia_)[^/]*$' \
    | xargs "$PY" -m pip install -q --no-index --no-deps --target "$SITE" \
    || echo "wheels: some failed to install" | tee -a "$SUMMARY"
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  [ "$DEVICE" = "cpu" ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)"
} | tee "$OUTDIR/machine.txt"

step tests 240 env ORTHRUS_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_real_engine.py tests/test_sampling.py
MODEL="$OUTDIR/model-$SIZE"
[ -d "$MODEL" ] || "$PY" -m orthrus_real.cli init-model "$MODEL" --size "$SIZE" --dtype "$DTYPE" \
  --seed 0 > /dev/null
step peers 150 "$PY" benchmarks/engine_peers.py --model "$MODEL" --device "$DEVICE" --repeats "$REPEATS"
step mix 260 "$PY" benchmarks/engine_mix.py --model "$MODEL" --streams "$STREAMS" --mixes 5:5,1:9 \
  --duration "$DURATION" --warmup "$WARMUP"
step calibrate 150 "$PY" -m orthrus_real.cli calibrate --model "$MODEL" --hardware "$HARDWARE" \
  --out "$OUTDIR/calibration.json" --load-seconds "$LOAD" --repeats 2
echo "== summary ==" && cat "$SUMMARY"
