"""The DFlash engine: pure PyTorch, no Ray."""

import os

# oneDNN (torch's CPU bf16 matmuls) caches a compiled primitive per distinct shape, 1,024 by default.
# Decoding makes a new attention shape at nearly every step (the context grows), so a serving process
# grew by ~60 MB a minute under load (dflash-serve soak) until the cache filled. 128 keeps the hot
# shapes (the linear layers' few batch x block shapes) at no measured cost. Set it to override.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
