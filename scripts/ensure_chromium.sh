#!/usr/bin/env bash
# Make sure a headless Chromium is on this machine (browser tests, PNG/SVG/PDF export).
# Playwright's and kaleido's own browser downloads do not work offline, so gradflow
# uses Debian's `chromium` package. Installs it only when missing and when we can.
set -u
for candidate in "${GRADFLOW_CHROMIUM:-}" chromium chromium-browser google-chrome; do
  if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1; then
    exit 0
  fi
done
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
  echo "gradflow: installing Debian's chromium (for browser tests and image export)..."
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null && apt-get install -y -qq chromium fonts-liberation >/dev/null && exit 0
fi
echo "gradflow: no Chromium found and cannot install it here." >&2
echo "          Install your distribution's chromium package (or set GRADFLOW_CHROMIUM=/path/to/chrome)." >&2
exit 1
