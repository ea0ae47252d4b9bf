#!/usr/bin/env bash
# Old code against new code on one GPU, interleaved, in one call: the engine figures
# (benchmarks/engine.py: warm TTFT, decode step at batch 1 and 64 over shared and over own
# chunks, sampled decode at batch 32) and the kernel table (benchmarks/kernel_bench.py). Both trees
# run the new tree's engine.py (it reaches the engine through the public API and a few long-
# standing engine attributes, so the two sides are measured by the same code); each tree runs
# its own kernel_bench.py (it calls the kernels' internals).
#
#   bash benchmarks/compare_trees.sh OLD_DIR NEW_DIR TOKENIZER_DIR [engine] [kernels] [ready] [matrix] \
#       [rounds=N] [matrix_args="--cells 24 --budget-s 300"]
#
# OLD_DIR and NEW_DIR hold a checkout each (e.g. `git archive REF | tar -x -C DIR`), carried to
# the GPU machine next to the tokenizer files (`python benchmarks/engine.py --save-tokenizer
# DIR`). Each tree is laid out as the installed package (lazyllm/, with kernels/ and
# integrations/ inside it, and its benchmarks/) under /tmp/tree_old and /tmp/tree_new, and runs
# from there with itself first on PYTHONPATH.
# Engine runs alternate old, new, old, new... (rounds, default 2); the summary prints every
# run and the new/old ratio of the medians. Logs and JSON go to $OUT.
set -uo pipefail
OLD=$(cd "$1" && pwd) NEW=$(cd "$2" && pwd) TOK=$(cd "$3" && pwd)
shift 3
OUT=${OUT:-/tmp/compare}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
what="" rounds=2 matrix_args=""
for a in "$@"; do
  case $a in
    rounds=*) rounds=${a#rounds=} ;;
    matrix_args=*) matrix_args=${a#matrix_args=} ;;
    *) what="$what $a" ;;
  esac
done
what=${what:-engine kernels}
for side in old new; do
  src=$OLD; [ $side = new ] && src=$NEW
  rm -rf "/tmp/tree_$side"; mkdir -p "/tmp/tree_$side"
  cp -R "$src/lazyllm" "/tmp/tree_$side/lazyllm"
  rm -f "/tmp/tree_$side/lazyllm/kernels" "/tmp/tree_$side/lazyllm/integrations"  # the source tree's links
  cp -R "$src/kernels" "/tmp/tree_$side/lazyllm/kernels"
  cp -R "$src/integrations" "/tmp/tree_$side/lazyllm/integrations"
  cp -R "$src/benchmarks" "/tmp/tree_$side/benchmarks"
  # older trees call the kernel table kernels.py, which, beside a script, shadows the kernels
  # package that newer transformers import
  [ -f "/tmp/tree_$side/benchmarks/kernel_bench.py" ] || \
    mv "/tmp/tree_$side/benchmarks/kernels.py" "/tmp/tree_$side/benchmarks/kernel_bench.py"
done
cp "$NEW/benchmarks/engine.py" "$NEW/benchmarks/_common.py" "$NEW/benchmarks/ttft_matrix.py" /tmp/tree_old/benchmarks/
run() {  # side, then the script and its arguments relative to that tree
  local side=$1; shift
  (cd "/tmp/tree_$side" && PYTHONPATH="/tmp/tree_$side${PYTHONPATH:+:$PYTHONPATH}" python3 "$@")
}
for w in $what; do
  case $w in
    engine)
      for i in $(seq 1 "$rounds"); do
        for side in old new; do
          echo "== engine $side round $i"
          run $side benchmarks/engine.py --tokenizer "$TOK" --json "$OUT/engine_${side}_$i.json" \
            >"$OUT/engine_${side}_$i.log" 2>&1 || tail -20 "$OUT/engine_${side}_$i.log"
        done
      done
      python3 - "$OUT" "$rounds" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
keys = ["warm_engine_ttft_ms", "warm_wall_ms", "warm_ttft_ms", "cold_ttft_ms", "decode_b1_step_ms", "decode_b64_step_ms", "decode_b64_distinct_step_ms",
        "decode_b32_sampled_step_ms"]
runs = {s: [json.load(open(f"{out}/engine_{s}_{i}.json")) for i in range(1, rounds + 1)] for s in ("old", "new")}
print("| figure | old runs (ms) | new runs (ms) | new/old (medians) |")
print("| --- | --- | --- | ---: |")
for k in keys:
    o, n = [r.get(k, float("nan")) for r in runs["old"]], [r.get(k, float("nan")) for r in runs["new"]]
    print(f"| {k} | {', '.join(f'{x:.2f}' for x in o)} | {', '.join(f'{x:.2f}' for x in n)} | "
          f"{statistics.median(n) / statistics.median(o):.3f} |")
EOF
      ;;
    kernels)
      for side in old new; do
        echo "== kernels $side"
        run $side benchmarks/kernel_bench.py --out "$OUT/kernels_$side" --page-size 64 --sections prefill,decode,copy \
          >"$OUT/kernels_$side.log" 2>&1 || tail -20 "$OUT/kernels_$side.log"
      done
      python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
rows = {s: json.load(open(f"{out}/kernels_{s}/kernels.json")) for s in ("old", "new")}
rows = {s: (r["rows"] if isinstance(r, dict) else r) for s, r in rows.items()}
def key(r):
    return (r.get("kind"), r.get("q"), r.get("batch"), r.get("kv"), r.get("pages"), str(r.get("config")),
            str(r.get("splits")))
new = {key(r): r for r in rows["new"]}
print("| kernel row | timing | old ms | new ms | new/old | RoPE cost old | RoPE cost new |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
for r in rows["old"]:
    n = new.get(key(r))
    t = next((t for t in ("ms_rope_graph_min", "ms_rope", "ms") if t in r), None)
    if n is None or t is None or t not in n:
        continue
    name = f"{r['kind']} " + " ".join(f"{k}={r[k]}" for k in ("q", "batch", "kv", "pages") if r.get(k) is not None)
    cost = "rope_cost_graph" if "rope_cost_graph" in r else "rope_cost"
    rc = [f"{100 * x[cost]:+.1f}%" if x.get(cost) is not None else "" for x in (r, n)]
    print(f"| {name} | {t} | {r[t]:.4f} | {n[t]:.4f} | {n[t] / r[t]:.3f} | {rc[0]} | {rc[1]} |")
EOF
      ;;
    ready)
      # time to ready, Llama-3.1-8B shapes: each tree's own ready child (families.py --child; in an
      # older tree first_request.py --child): its model build, LazyLLM with its warm-up, its first
      # requests; once on an empty Triton cache of its own, then `rounds` times on that cache (warm),
      # alternating old, new, new, old...
      for side in old new; do rm -rf "/tmp/triton_$side"; done
      ready() {  # side, cache label
        local side=$1 label=$2
        echo "== ready $side ($label Triton cache)"
        local script=benchmarks/families.py
        [ -f "/tmp/tree_$side/benchmarks/first_request.py" ] && script=benchmarks/first_request.py
        (cd "/tmp/tree_$side" && TRITON_CACHE_DIR="/tmp/triton_$side" PYTHONPATH="/tmp/tree_$side${PYTHONPATH:+:$PYTHONPATH}" python3 \
          "$script" --child ready:llama --tokenizer "$TOK" >"$OUT/ready_${side}_$label.log" 2>&1) \
          || tail -20 "$OUT/ready_${side}_$label.log"
        grep '^FIRST_REQUEST_RESULT ' "$OUT/ready_${side}_$label.log" | cut -d' ' -f2- >"$OUT/ready_${side}_$label.json"
      }
      ready old empty; ready new empty
      for i in $(seq 1 "$rounds"); do
        if [ $((i % 2)) = 1 ]; then order="old new"; else order="new old"; fi
        for side in $order; do ready $side "warm$i"; done
      done
      python3 - "$OUT" "$rounds" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def load(side, label):
    with open(f"{out}/ready_{side}_{label}.json") as fh:
        return json.load(fh)
print("| Triton cache | old: ready s (warm-up s; kernels, graphs) | new | new/old (medians) |")
print("| --- | --- | --- | ---: |")
def cell(r):
    w = r.get("warmup") or {}
    return (f"{r['ready_s']:.2f} ({w.get('seconds', float('nan')):.1f}; {w.get('kernels_compiled', '?')}, "
            f"{w.get('decode_graphs', '?')} + {w.get('prefill_graphs', '?')})")
for labels in (["empty"], [f"warm{i}" for i in range(1, rounds + 1)]):
    o, n = [load("old", x) for x in labels], [load("new", x) for x in labels]
    ratio = statistics.median(r["ready_s"] for r in n) / statistics.median(r["ready_s"] for r in o)
    print(f"| {labels[0].rstrip('0123456789')} | {'; '.join(map(cell, o))} | {'; '.join(map(cell, n))} | {ratio:.3f} |")
EOF
      ;;
    matrix)
      rm -rf /tmp/matrix_turns; pids=
      for side in old new; do
        # shellcheck disable=SC2086
        (cd "/tmp/tree_$side" && TRITON_CACHE_DIR=/tmp/triton_matrix PYTHONPATH="/tmp/tree_$side${PYTHONPATH:+:$PYTHONPATH}" python3 \
          benchmarks/ttft_matrix.py --tokenizer "$TOK" --turns /tmp/matrix_turns --side $side --rounds "$rounds" \
          --json "$OUT/matrix_$side.json" $matrix_args >"$OUT/matrix_$side.log" 2>&1) &
        pids="$pids $!"
      done
      # one side failing leaves the other waiting for its turn: end both
      # shellcheck disable=SC2086
      while [ -n "$(jobs -pr)" ]; do
        wait -n || { echo "== matrix: a side failed"; kill $pids 2>/dev/null; }
      done
      tail -n 5 "$OUT/matrix_old.log" "$OUT/matrix_new.log"
      (cd /tmp/tree_new && PYTHONPATH="/tmp/tree_new${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/ttft_matrix.py \
        --compare "$OUT/matrix_old.json" "$OUT/matrix_new.json")
      ;;
    *) echo "unknown: $w (engine | kernels | ready | matrix | rounds=N | matrix_args=...)"; exit 2 ;;
  esac
done
