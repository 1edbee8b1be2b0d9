#!/usr/bin/env bash
# Here, before a lent GPU machine's run: put in .whl/ the wheels it lacks and in .gpu/ the default
# model's GGUF, xz-compressed, in parts of at most $PART_MB MiB (default 46), with the GGUF's sha256.
# Both folders are ignored by git; name them in the device calls' `carry` (one part per call, in
# consecutive calls: a warm machine keeps what earlier calls left in ignored folders).
set -euo pipefail
cd "$(dirname "$0")/.."
PART_MB="${PART_MB:-46}"
mkdir -p .whl .gpu
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  gguf==0.19.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
GGUF="$(.venv/bin/python -c 'from engine.default_model import gguf_path; print(gguf_path())')"
rm -f .gpu/gguf.xz.part*
xz -T0 -6 -c "$GGUF" | split -b "${PART_MB}M" -d -a 1 - .gpu/gguf.xz.part
sha256sum < "$GGUF" | cut -d' ' -f1 > .gpu/gguf.sha256
ls -l .whl .gpu
