#!/usr/bin/env bash
# The main job on the default model: stream a generation, then a short side-by-side benchmark.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
.venv/bin/dflash-serve generate --prompt "Write a Python function that checks whether a number is prime." --max-new-tokens 96
.venv/bin/dflash-serve bench --num-prompts 4 --max-new-tokens 64 --methods hf,ar,dflash,zlab --json results/bench.json --plot results/bench.png
