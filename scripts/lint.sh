#!/usr/bin/env bash
# Lint: ruff over the tree, then the import contracts of pyproject.toml ([tool.importlinter]).
# Fails on the first that fails. Expects the test tools (scripts/setup.sh test; test.sh runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bin=$(cd "${LAZYLLM_VENV:-.venv}/bin" && pwd)

"$bin/ruff" check .

# lazyllm.kernels and lazyllm.integrations are namespace packages reached through links
# (lazyllm/kernels -> ../kernels), which import-linter does not follow. Check a copy with the
# links resolved and an __init__.py in each, as a regular package would have.
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
cp -RL lazyllm "$tree/lazyllm"
touch "$tree/lazyllm/kernels/__init__.py" "$tree/lazyllm/integrations/__init__.py"
find "$tree" -name __pycache__ -prune -exec rm -rf {} +
(cd "$tree" && PYTHONPATH="$tree" "$bin/lint-imports" --no-cache "$root/pyproject.toml")
