#!/usr/bin/env bash
# Set up on a fresh machine, then run the whole test suite (unit tests and default-model tests).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
