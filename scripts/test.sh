#!/usr/bin/env bash
# The test suite (CPU; Triton kernels run in Triton's interpreter). Extra args go to pytest.
# Lints first (scripts/lint.sh: ruff, import contracts) and fails if that fails;
# LAZYLLM_LINT=0 skips the lint, for a quick run of a few tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
if [ "${LAZYLLM_LINT:-1}" != 0 ]; then
  scripts/lint.sh
fi
export TOKENIZERS_PARALLELISM=false
exec "${LAZYLLM_VENV:-.venv}/bin/python" -m pytest -q -m "not gpu" --timeout=1800 "$@"
