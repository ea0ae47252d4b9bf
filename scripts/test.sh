#!/usr/bin/env bash
# The test suite (CPU; Triton kernels run in Triton's interpreter). Extra args go to pytest.
#   scripts/test.sh [pytest args]            on the tested dependency set (scripts/constraints.txt)
#   scripts/test.sh --latest [pytest args]   on the newest releases, in .venv-latest/
# Lints first (scripts/lint.sh: ruff, import contracts) and fails if that fails;
# LAZYLLM_LINT=0 skips the lint, for a quick run of a few tests.
# Two pytest-xdist workers where there are two cores, a test module to a worker (module
# fixtures load their models once); `-n 0` among the args runs everything in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --latest ]; then
  shift
  export LAZYLLM_VENV=${LAZYLLM_VENV:-.venv-latest}
  scripts/setup.sh test --latest
else
  scripts/setup.sh test
fi
if [ "${LAZYLLM_LINT:-1}" != 0 ]; then
  scripts/lint.sh
fi
export TOKENIZERS_PARALLELISM=false
workers=$(nproc 2>/dev/null || echo 1)
[ "$workers" -ge 2 ] && workers=2 || workers=0
exec "${LAZYLLM_VENV:-.venv}/bin/python" -m pytest -q -m "not gpu" --timeout=1800 --durations=20 \
  -n "$workers" --dist loadfile "$@"
