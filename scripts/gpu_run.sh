#!/usr/bin/env bash
# The prepared run for a lent GPU machine (engine/gpu_run.py): `bash scripts/gpu_run.sh [check,train,costs] [flags]`.
# Uses the machine's python3 and only what travels with the tree: wheels in .whl/ (scripts/gpu_pack.sh puts
# them there), the default model's GGUF, xz-compressed, in parts in .gpu/ (one part per call, consecutive calls). Results go to
# $RUN_DIR (default $OUT); with RUN_DIR set, $OUT gets them bundled (a device call returns at most 8 files):
# log.txt, run.tar.gz and the trained drafter's model.safetensors.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dflash-site .whl/*.whl; then
    export PYTHONPATH="/tmp/dflash-site"
  else
    echo "gpu_run.sh: the wheels in .whl/ do not install here; going on with this python's own packages" >&2
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# training allocates tensors of a new size every step: grown segments keep the allocator from fragmenting
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
# A call's carry replaces .gpu/ on the machine, so what earlier calls brought is kept outside the working copy
# (the machine keeps /tmp while it stays warm between calls): the GGUF parts, the GGUF, the converted model.
STASH="${GPU_STASH:-/tmp/dflash-gpu}"
mkdir -p "$STASH"
for f in .gpu/gguf.xz.part* .gpu/gguf.sha256; do [ -f "$f" ] && cp "$f" "$STASH/"; done
GGUF="$STASH/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$GGUF" ] && compgen -G "$STASH/gguf.xz.part*" >/dev/null && [ -f "$STASH/gguf.sha256" ]; then
  cat "$STASH"/gguf.xz.part* | "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' > "$GGUF.tmp"
  if [ "$(sha256sum < "$GGUF.tmp" | cut -d' ' -f1)" = "$(cat "$STASH/gguf.sha256")" ]; then
    mv "$GGUF.tmp" "$GGUF"
  else
    echo "gpu_run.sh: the GGUF parts in $STASH do not add up (sha256 differs): carry every part, in calls to one warm machine" >&2
    rm -f "$GGUF.tmp"
    exit 3
  fi
fi
if [ -f "$GGUF" ]; then
  export DFLASH_SERVE_GGUF="$GGUF" DFLASH_SERVE_CACHE="${DFLASH_SERVE_CACHE:-$STASH/cache}"
fi
RUN_DIR="${RUN_DIR:-$OUT}"
# RUN_TIMEOUT: seconds after which the run is stopped, leaving time to bundle what it made (a call's limit)
timeout "${RUN_TIMEOUT:-86400}" "$PY" -m engine.gpu_run --out "$RUN_DIR" "$@" 2>&1 | tee -a "$OUT/log.txt"
status="${PIPESTATUS[0]}"
if [ "$RUN_DIR" != "$OUT" ]; then
  tar czf "$OUT/run.tar.gz" -C "$RUN_DIR" --exclude=model.safetensors --exclude=tiny-target .
  [ -f "$RUN_DIR/train/drafter/model.safetensors" ] && cp "$RUN_DIR/train/drafter/model.safetensors" "$OUT/"
fi
exit "$status"
