"""What a process that runs an engine sets up at start-up, before its first matmul: the server's
replicas and shards, and the `dflash-serve` commands call it; importing the engine changes nothing.
"""

import os


def cap_matmul_caches():
    """Cap torch's two CPU caches of what bf16 matmuls build per distinct shape (oneDNN's primitive cache
    and ideep's LRU_CACHE_CAPACITY, 1,024 entries each by default) at 128 entries. Decoding makes new
    shapes all the time, so a serving process otherwise grows until both are full (docs/design.md);
    128 keeps the hot shapes. Both are read at the process's first matmul; set either variable to override."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
    os.environ.setdefault("LRU_CACHE_CAPACITY", "128")
