#!/usr/bin/env bash
# The main job: set up, then serve the default model with DFlash on http://127.0.0.1:8000/v1
# (OpenAI API) from a local loopback Ray cluster. Flags pass through: ./run.sh --port 8001 --policy adaptive
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/dflash-serve serve "$@"
