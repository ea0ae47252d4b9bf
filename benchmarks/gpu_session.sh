#!/usr/bin/env bash
# One call on the GPU machine: install the working tree, run the GPU tests and the engine
# benchmark, leave logs under $OUT. Usage there: bash benchmarks/gpu_session.sh [what...]
# what: tests | engine | engine-sync | gemm | profile | kernels   (default: tests engine)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false LAZYLLM_TEST_TOKENIZER=$PWD/.carry/tok
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || \
  python3 -m pip install -q --no-deps --no-build-isolation . >>"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
what=${*:-tests engine}
for w in $what; do
  case $w in
    tests) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_kernels_triton.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -12 ;;
    engine) python3 benchmarks/engine.py --tokenizer .carry/tok --json "$OUT/engine.json" 2>&1 | tee "$OUT/engine.log" | grep -v Warn | tail -9 ;;
    engine-sync) python3 benchmarks/engine.py --tokenizer .carry/tok --no-overlap --json "$OUT/engine_sync.json" 2>&1 | tee "$OUT/engine_sync.log" | grep -v Warn | tail -10 ;;
    engine64) python3 benchmarks/engine.py --tokenizer .carry/tok --page-size 64 --json "$OUT/engine64.json" 2>&1 | tee "$OUT/engine64.log" | grep -v Warn | tail -9 ;;
    gemm) python3 benchmarks/gemm_probe.py --json "$OUT/gemm_probe.json" 2>&1 | tee "$OUT/gemm_probe.log" | tail -12 ;;
    profile) python3 benchmarks/profile_engine.py --tokenizer .carry/tok 2>&1 | tee "$OUT/profile.log" | grep -v Warn | tail -70 ;;
    kernels) python3 benchmarks/kernels.py --out "$OUT" --page-size 64 --run-loops 2>&1 | tee "$OUT/kernels.log" | tail -40 ;;
  esac
done
