#!/usr/bin/env bash
# The GPU check of the PyTorch engine, for a bare GPU machine (Python with torch + CUDA,
# transformers, numpy and scipy; no package index), sized to finish in under 8 minutes:
#   1. the project's other dependencies from wheels carried in WHEELS (default: wheels/), into
#      OUT/site (nothing installed system-wide);
#   2. the engine tests on the GPU (tests/test_real_engine.py, test_sampling.py and
#      test_paged_attention.py, on DEVICE, fp32, with GPU tolerances);
#   3. one decode step of 64 streams at context 128 under each path (benchmarks/engine/decode_step.py):
#      gather attention (contexts gathered every step, and kept between steps), paged (the cache
#      read in place), paged + the static step, paged +
#      CUDA graphs: step time, kernel launches and GPU kernel time per step (torch.profiler);
#   4. the engine against transformers on the same GPU (benchmarks/engine/peers.py, `1b`, bf16),
#      with today's path and with paged attention + CUDA graphs;
#   5. benchmarks/engine/mix.py at 64 streams, mixes 5:5 and 1:9;
#   6. orthrus-real calibrate --hardware HARDWARE (default h200), 20 s of mixed load.
# Each step has a time limit (cut to what is left of a 460 s budget, BUDGET_S; 3600 s for the
# CPU dry run, whose limits per step are doubled) and its own log
# in OUT (default: out/gpu_check); a failing step is recorded in OUT/summary.txt and the next
# one runs.
#
# Prepare the wheels where a package index is reachable, for the GPU machine's Python (3.12 here):
#   pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
#     -d wheels -r benchmarks/gpu_check_wheels.txt
# then `rm wheels/numpy-*` (15.0 MiB; the machine's own numpy is used) and carry wheels/ with
# the checkout.
# The wheels carried (cp312, manylinux x86_64; downloaded 2026-12-01), 53 files,
# 41.3 MiB in all (limit 64 MiB); MiB in brackets where 1 MiB or more:
#   annotated_doc 0.0.7, annotated_types 0.8.0, anyio 4.16.0, certifi 2026.10.19.post1,
#   click 8.5.1, contourpy 1.4.0, cycler 0.12.1, fastapi 0.165.0, filelock 4.3.1,
#   fonttools 4.68.0 (5.2), fsspec 2026.9.0, h11 0.16.0, hf_xet 1.8.0 (4.1), httpcore 1.0.9,
#   httpcore2 2.16.2, httpx 0.28.1, httpx2 2.16.2, huggingface_hub 2.4.0,
#   hypothesis 6.170.17 (1.1), idna 3.20, iniconfig 2.3.1, jinja2 3.1.6, kiwisolver 1.5.1 (1.4),
#   markdown_it_py 4.3.0, markupsafe 3.0.4, matplotlib 3.11.2 (9.4), mdurl 0.1.2,
#   opentelemetry_api 1.45.2, packaging 26.4, pillow 13.0.0 (6.8), pluggy 1.7.0,
#   prometheus_client 0.26.0, pydantic 2.14.4, pydantic_core 2.50.5 (2.2), pygments 2.21.0 (1.2),
#   pyparsing 3.3.3, pytest 9.2.0, python_dateutil 4.0.0, pyyaml 6.0.4, rich 15.0.0,
#   safetensors 0.8.0, shellingham 1.5.4, simpy 4.1.2, sortedcontainers 2.4.0, starlette 1.10.0,
#   tokenizers 0.23.3 (3.2), tqdm 4.70.1, truststore 0.10.5, typer 0.29.2,
#   typing_extensions 4.16.0, typing_inspection 0.4.5, tzdata 2026.6, uvicorn 0.54.0
# The compiled paged-attention kernel (FlexAttention) needs the machine's triton, which comes with
# a CUDA build of torch; without it the engine logs why and runs the block-wise path.
# A dry run on a CPU checks the script itself (tiny model, short runs, the static step without
# capture): DEVICE=cpu bash benchmarks/gpu_check.sh
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
  SIZE=tiny; DTYPE=float32; DURATION=4; WARMUP=1; STREAMS=4; LOAD=3; REPEATS=1; STEPS=3
else
  SIZE=1b; DTYPE=bfloat16; DURATION=10; WARMUP=2; STREAMS=64; LOAD=20; REPEATS=2; STEPS=10
fi

# the whole check ends within 8 minutes on a GPU; the CPU dry run checks the script, untimed
DEADLINE=$((SECONDS + ${BUDGET_S:-$([ "$DEVICE" = cpu ] && echo 3600 || echo 460)}))
step() {  # step NAME LIMIT_S COMMAND...: run, log to OUT/NAME.log, note the outcome
  local name=$1 limit=$2; shift 2
  local start=$SECONDS left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 15 ]; then
    echo "$name: skipped (the 8-minute budget is spent)" | tee -a "$SUMMARY"; return
  fi
  [ "$DEVICE" = cpu ] && limit=$((limit * 2))
  [ "$left" -lt "$limit" ] && limit=$left
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

# the dry run checks the script on a shared 2-core CPU: the two fast files of the three
TESTS="tests/test_sampling.py tests/test_paged_attention.py"
[ "$DEVICE" = "cpu" ] || TESTS="tests/test_real_engine.py $TESTS"
# shellcheck disable=SC2086
step tests 200 env ORTHRUS_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -p no:cacheprovider $TESTS
MODEL="$OUTDIR/model-$SIZE"
[ -d "$MODEL" ] || "$PY" -m orthrus_real.cli init-model "$MODEL" --size "$SIZE" --dtype "$DTYPE" \
  --seed 0 > /dev/null
if [ "$DEVICE" = "cpu" ]; then VARIANTS=gather,gather+kept,paged,paged+static; else
  VARIANTS=gather,gather+kept,paged,paged+static,paged+graphs; fi
step decode 100 "$PY" -m benchmarks.engine.decode_step --model "$MODEL" --device "$DEVICE" \
  --streams "$STREAMS" --steps "$STEPS" --variants "$VARIANTS"
step peers 100 "$PY" -m benchmarks.engine.peers --model "$MODEL" --device "$DEVICE" \
  --repeats "$REPEATS" --no-paths
if [ "$DEVICE" = "cpu" ]; then FAST="--attention paged --static-step"; else
  FAST="--attention paged --cuda-graphs"; fi
# shellcheck disable=SC2086
step peers-paged 100 "$PY" -m benchmarks.engine.peers --model "$MODEL" --device "$DEVICE" \
  --repeats "$REPEATS" --no-paths $FAST
step mix 200 "$PY" -m benchmarks.engine.mix --model "$MODEL" --streams "$STREAMS" --mixes 5:5,1:9 \
  --duration "$DURATION" --warmup "$WARMUP"
step calibrate 120 "$PY" -m orthrus_real.cli calibrate --model "$MODEL" --hardware "$HARDWARE" \
  --out "$OUTDIR/calibration.json" --load-seconds "$LOAD" --repeats 2
echo "== summary ==" && cat "$SUMMARY"
