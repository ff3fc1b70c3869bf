#!/usr/bin/env bash
# Install gradflow and start the dashboard at http://localhost:8501 on the
# bundled digits data set (no download needed). Usage: bash scripts/serve.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --disable-pip-version-check -q -r requirements.txt
python3 -m pip install --disable-pip-version-check -q --no-deps -e .
# Chromium is only needed for PNG/SVG/PDF export; the dashboard runs without it.
bash scripts/ensure_chromium.sh || echo "gradflow: image export disabled (no Chromium); HTML and CSV export still work."
# ADDRESS=0.0.0.0 serves a classroom network; the default is this machine only.
exec python3 -m streamlit run app.py --server.port "${PORT:-8501}" --server.address "${ADDRESS:-127.0.0.1}" --server.headless true
