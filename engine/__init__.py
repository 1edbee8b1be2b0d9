"""The DFlash engine: pure PyTorch, no Ray."""

import os

# torch's CPU bf16 matmuls keep what they build for each distinct shape in two caches, 1,024 entries
# each by default: oneDNN's primitive cache and ideep's computation cache (LRU_CACHE_CAPACITY), ~0.4 MB
# an entry (torch 2.13). Decoding makes new shapes all the time (the context grows; prefill widths and
# batch x block rows vary), so a serving process grew by 30-60 MB a minute under load (dflash-serve
# soak) until both filled (~0.8 GB). 128 each keeps the hot shapes (the linear layers' few batch x block
# shapes) at no measured cost; a bf16 matmul over 1,000 new shapes then grows ~160 MB instead of ~460 MB
# (scripts/matmul_cache_memory.py). Set either variable to override.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
os.environ.setdefault("LRU_CACHE_CAPACITY", "128")
