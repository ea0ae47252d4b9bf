#!/usr/bin/env bash
# The main job: a RAG demo on the embedded default model, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh demo
exec "${LAZYLLM_VENV:-.venv}/bin/python" examples/rag_demo.py "$@"
