# The rotary-halves short path (LAZYLLM_SHORT_HALVES) checked in the engine, in one device
# call of about 5 minutes: the Gluon routing tests, benchmarks/engine.py with the flat loop
# and with the rotary halves, and the engine's decode call replayed alone
# (benchmarks/decode_launch.py). Run from the repository root, the tokenizer under
# .carry/tok, $OUT a folder for the logs:  OUT=out bash benchmarks/gpu_short_halves_ab.sh
set -u
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip failed"
export LAZYLLM_TEST_TOKENIZER=$PWD/.carry/tok
mkdir -p $OUT/short_halves_ab
timeout 120 python3 -m pytest -q -m gpu tests/test_gluon_prefill.py -p no:cacheprovider > $OUT/short_halves_ab/gpu_tests_gluon.log 2>&1; echo "gluon tests rc=$?"; tail -1 $OUT/short_halves_ab/gpu_tests_gluon.log
for v in 0 auto; do
  LAZYLLM_SHORT_HALVES=$v timeout 100 python3 benchmarks/engine.py --tokenizer .carry/tok --json $OUT/short_halves_ab/engine_$v.json > $OUT/short_halves_ab/engine_$v.log 2>&1; echo "== engine SHORT_HALVES=$v rc=$?"
  grep -E "^\| (TTFT|decode)" $OUT/short_halves_ab/engine_$v.log | cut -c1-150
done
timeout 200 python3 benchmarks/decode_launch.py --tokenizer .carry/tok --json $OUT/short_halves_ab/decode_launch.json > $OUT/short_halves_ab/decode_launch.log 2>&1; echo "decode_launch rc=$?"
grep -E "^SHORT_HALVES|used entries" $OUT/short_halves_ab/decode_launch.log | cut -c1-140
