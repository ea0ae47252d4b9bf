#!/usr/bin/env bash
# The test suite (CPU; Triton kernels run in Triton's interpreter). Extra args go to pytest.
#   scripts/test.sh [pytest args]            on the tested dependency set (scripts/constraints.txt)
#   scripts/test.sh --latest [pytest args]   on the newest releases, in .venv-latest/
# Lints first (scripts/lint.sh: ruff, import contracts) and fails if that fails;
# LAZYLLM_LINT=0 skips the lint, for a quick run of a few tests.
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
exec "${LAZYLLM_VENV:-.venv}/bin/python" -m pytest -q -m "not gpu" --timeout=1800 --durations=20 "$@"
