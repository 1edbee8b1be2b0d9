"""What a ragged verify costs: the target verifying rows of different sizes (the adaptive policy's trim cuts
some rows short) against dense verifies at the mean size and at the widest row's size. The target runs its
linear layers on real positions only but attention on the padded [batch, widest] layout; the share
(ragged - dense at the mean) / (dense at the widest - dense at the mean) is what CostModel.ragged_share
stands for: 0 when only real positions cost, 1 when a ragged verify costs as much as its widest row's.

    .venv/bin/python scripts/ragged_verify.py --batch 4,16 --contexts 256,1024

Medians of --repeats timings, the cases taking turns so a slow spell of the host hits all of them.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.cli import comma_list  # noqa: E402
from engine.loading import load  # noqa: E402
from engine.policy import interleaved_times  # noqa: E402

WIDTH = 4


def layouts(batch):
    """Ragged layouts of `batch` rows, each row at most WIDTH positions."""
    quarter = max(batch // 4, 1)
    return {
        "half at 3, half at 1": [3] * (batch // 2) + [1] * (batch - batch // 2),
        "a quarter at 4, the rest at 1-2": [4] * quarter + [1] * (batch - 2 * quarter) + [2] * quarter,
        "half at 4, half at 1": [4] * (batch // 2) + [1] * (batch - batch // 2),
        "one at 4, the rest at 2": [4] + [2] * (batch - 1),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=comma_list(int), default=[4, 16])
    ap.add_argument("--contexts", type=comma_list(int), default=[256, 1024], help="cached positions per row")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    if min(args.batch) < 2 or min(args.contexts) < 1 or args.repeats < 1:
        ap.error("--batch must be >= 2, --contexts and --repeats >= 1")
    torch.set_num_threads(1)
    loaded = load(None, "default", args.dtype, "cpu")
    target, features = loaded.target, tuple(loaded.drafter.config.target_layer_ids)
    cache = target.new_cache(max(args.batch), max(args.contexts) + WIDTH)

    def verify(sizes, context):
        width, offsets = max(sizes), torch.arange(max(sizes))
        positions = torch.stack([torch.where(offsets < s, context + offsets, -1) for s in sizes])
        ids = torch.full(positions.shape, 5)
        return lambda: target(ids, positions, cache, list(range(len(sizes))), context + width, features)

    shares = []
    print("| batch | context | rows | mean size | ragged ms | dense at the mean ms | dense at the widest ms | share |")
    print("|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for batch in args.batch:
            for context in args.contexts:
                cases = {**{f"dense {b}": [b] * batch for b in range(1, WIDTH + 1)}, **layouts(batch)}
                calls = {name: verify(sizes, context) for name, sizes in cases.items()}
                times = interleaved_times(calls, args.repeats)
                ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
                dense = [ms[f"dense {b}"] for b in range(1, WIDTH + 1)]
                for name, sizes in layouts(batch).items():
                    mean = sum(sizes) / batch
                    whole = int(mean) - 1
                    at_mean = dense[whole] + (mean - 1 - whole) * (dense[whole + 1] - dense[whole] if whole + 1 < WIDTH else 0)
                    at_widest = dense[max(sizes) - 1]
                    share = (ms[name] - at_mean) / (at_widest - at_mean)
                    shares.append(share)
                    print(f"| {batch} | {context} | {name} | {mean:.2f} | {ms[name]:.1f} | {at_mean:.1f} | {at_widest:.1f} "
                          f"| {share:.2f} |", flush=True)
    print(f"\nmedian share {statistics.median(shares):.2f} over {len(shares)} layouts (CostModel.ragged_share)")


if __name__ == "__main__":
    main()
