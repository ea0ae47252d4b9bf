#!/usr/bin/env bash
# The test suite (CPU; Triton kernels run in Triton's interpreter). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
export TOKENIZERS_PARALLELISM=false
exec "${LAZYLLM_VENV:-.venv}/bin/python" -m pytest -q -m "not gpu" --timeout=1800 "$@"
