#!/usr/bin/env bash
# Lint: ruff over the tree, then the import contracts of pyproject.toml ([tool.importlinter]).
# Fails on the first that fails. Expects the test tools (scripts/setup.sh test; test.sh runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bin=$(cd "${LAZYLLM_VENV:-.venv}/bin" && pwd)

"$bin/ruff" check .

# lazyllm.kernels and lazyllm.integrations live in kernels/ and integrations/ (package-dir in
# pyproject.toml), outside lazyllm/, where import-linter does not look. Check a copy laid out
# as the installed package instead.
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
cp -R lazyllm "$tree/lazyllm"
cp -R kernels "$tree/lazyllm/kernels"
cp -R integrations "$tree/lazyllm/integrations"
find "$tree" -name __pycache__ -prune -exec rm -rf {} +
(cd "$tree" && PYTHONPATH="$tree" "$bin/lint-imports" --no-cache "$root/pyproject.toml")
