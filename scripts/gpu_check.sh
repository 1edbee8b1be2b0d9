#!/usr/bin/env bash
# One prepared GPU check (for a lent GPU machine, inside its time budget): set up with the CUDA
# torch build, run the CUDA tests, then a short bf16 bench. Results land in $OUT (or ./results).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results}"
mkdir -p "$OUT"
TORCH_SPEC="${TORCH_SPEC:-torch}" DFLASH_EXTRAS=dev bash scripts/setup.sh
.venv/bin/python -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/gpu.txt"
.venv/bin/python -m pytest -q tests/test_gpu.py tests/test_sampling.py 2>&1 | tee -a "$OUT/gpu.txt"
.venv/bin/dflash-serve bench --device cuda --dtype bfloat16 --num-prompts 4 --max-new-tokens 128 \
  --methods hf,zlab,ar,dflash --batch-size 8 --json "$OUT/bench-cuda.json" --plot "$OUT/bench-cuda.png" \
  2>/dev/null | tee -a "$OUT/gpu.txt"
