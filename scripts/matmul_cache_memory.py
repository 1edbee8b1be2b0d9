"""How much memory torch's CPU bf16 matmuls keep per distinct shape, with the caps engine/__init__.py sets
and with torch's defaults: one process per setting (the caches are read once per process) runs a linear
layer over `--shapes` different row counts and prints RSS growth every 200 shapes.

    .venv/bin/python scripts/matmul_cache_memory.py --shapes 1000
"""

import argparse
import os
import subprocess
import sys

CHILD = """
import psutil, torch, torch.nn.functional as F
torch.set_num_threads(1)
w = torch.randn(1536, 576, dtype=torch.bfloat16)
proc = psutil.Process()
start, out = proc.memory_info().rss, []
for i, rows in enumerate(range(100, 100 + 2 * {shapes}, 2)):  # a new shape every call
    F.linear(torch.randn(rows, 576, dtype=torch.bfloat16), w)
    if i % 200 == 199:
        out.append(f"{{(proc.memory_info().rss - start) / 2**20:.0f}}")
print(" ".join(out))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\\n")[0])
    parser.add_argument("--shapes", type=int, default=1000)
    args = parser.parse_args()
    settings = {"engine (128, 128)": ("128", "128"), "torch defaults (1024, 1024)": ("1024", "1024")}
    print(f"RSS growth in MB after every 200 of {args.shapes} new bf16 linear shapes "
          "(ONEDNN_PRIMITIVE_CACHE_CAPACITY, LRU_CACHE_CAPACITY):")
    for name, (onednn, lru) in settings.items():
        env = {**os.environ, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": onednn, "LRU_CACHE_CAPACITY": lru}
        result = subprocess.run([sys.executable, "-c", CHILD.format(shapes=args.shapes)], env=env,
                                capture_output=True, text=True, check=True)
        print(f"  {name:>28}: {result.stdout.strip()}")


if __name__ == "__main__":
    main()
