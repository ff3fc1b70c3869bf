#!/usr/bin/env bash
# Install gradflow with its test dependencies and run the whole test suite,
# the real-browser tests included. Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --disable-pip-version-check -q -r requirements-test.txt
python3 -m pip install --disable-pip-version-check -q --no-deps -e .
bash scripts/ensure_chromium.sh
python3 -m ruff check .
python3 -m ruff format --check .
exec python3 -m pytest "$@"
