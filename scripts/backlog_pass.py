"""What a drafter backlog costs padded into the block pass against a pass of its own (Engine._take_backlogs):
the default drafter's forward over `--width` context positions plus a block of 2, for a batch of 16 rows
padded to the width, one row alone, and 16 rows with no backlog; fastest of 3 after a warm-up, one thread.

    .venv/bin/python scripts/backlog_pass.py --width 800
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.loading import load  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=800, help="backlog positions (an 800-token RAG prompt)")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    if args.width < 1:
        ap.error("--width must be >= 1")
    torch.set_num_threads(1)
    loaded = load(None, "default", args.dtype, "cpu")
    drafter, hidden = loaded.drafter, loaded.target.config.hidden_size
    features = len(drafter.config.target_layer_ids) * hidden
    cache = drafter.new_cache(16, args.width + 8)

    @torch.inference_mode()
    def ms(batch, width, block=2):
        ctx = torch.zeros(batch, width, features, dtype=drafter.dtype)
        x = torch.zeros(batch, block, hidden, dtype=drafter.dtype)
        positions = torch.arange(width + block).expand(batch, width + block)
        end = torch.full((batch,), width + block)
        times = []
        for _ in range(4):
            start = time.perf_counter()
            drafter(ctx, x, positions, cache, torch.arange(batch), width + block, end)
            times.append(time.perf_counter() - start)
        return 1e3 * min(times[1:])

    padded, alone, block = ms(16, args.width), ms(1, args.width), ms(16, 2)
    print(f"16 rows padded to a {args.width}-position backlog: {padded:.1f} ms; that row alone {alone:.1f} ms "
          f"+ the 16 rows' block pass {block:.1f} ms = {alone + block:.1f} ms ({padded / (alone + block):.1f}x less)")


if __name__ == "__main__":
    main()
