"""Per-step cost of a pipeline-sharded target (deployments/shards.py) against the same target in-process.

Times the verifier's forward (the target over a block at a given context, with the drafter's feature
layers) for the unsharded target and for N TargetShard actors on a loopback Ray cluster of this
machine, alternating the two every repeat so that machine noise hits both alike; prints the median
ms/step of each and their ratio. Both sides use the same torch threads per process (--threads).

    .venv/bin/python scripts/shard_overhead.py --num-shards 2 --shapes 1x1,1x16,4x16 --repeats 30
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray reads it at import: loopback only
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
import torch  # noqa: E402

from deployments.shards import ShardedTarget  # noqa: E402
from engine.loading import load  # noqa: E402
from engine.policy import interleaved_times  # noqa: E402


def step_fn(target, cache, batch, block, context, feature_layers):
    """One verify forward of `batch` rows at positions context..context+block-1 (scratch cache)."""
    slots = list(range(batch))
    block_ids = torch.full((batch, block), 1, dtype=torch.long)
    positions = (context + torch.arange(block)).expand(batch, block)

    @torch.inference_mode()
    def step():
        target(block_ids, positions, cache, slots, context + block, feature_layers)

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-shards", type=int, default=2)
    parser.add_argument("--shapes", default="1x1,1x16,4x16", help="batch x block, comma-separated")
    parser.add_argument("--context", type=int, default=256, help="positions already cached per row")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch threads here and in each shard")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    ray.init(address="local", num_cpus=args.num_shards * args.threads, include_dashboard=False,
             _node_ip_address="127.0.0.1", runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    loaded = load(None, "default", args.dtype)
    feature_layers = tuple(loaded.drafter.config.target_layer_ids)
    sharded = ShardedTarget(None, args.num_shards, loaded.dtype, num_cpus=args.threads)
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    max_batch, max_block = max(b for b, _ in shapes), max(k for _, k in shapes)
    targets = {1: loaded.target, args.num_shards: sharded}
    caches = {n: t.new_cache(max_batch, args.context + max_block) for n, t in targets.items()}
    results = []
    print(f"{loaded.target_path.name} {loaded.dtype}, context {args.context}, {args.threads} thread(s) per process, "
          f"median of {args.repeats}; shards hold layers {sharded.layer_ranges}")
    print(f"{'batch x block':>13} {'N=1 ms':>8} {f'N={args.num_shards} ms':>8} {'ratio':>6} {'extra ms':>8}")
    for batch, block in shapes:
        steps = {n: step_fn(t, caches[n], batch, block, args.context, feature_layers) for n, t in targets.items()}
        times = interleaved_times(steps, args.repeats)
        one, many = (statistics.median(times[n]) * 1000 for n in (1, args.num_shards))
        results.append({"batch": batch, "block": block, "ms_unsharded": one, "ms_sharded": many, "ratio": many / one})
        print(f"{f'{batch} x {block}':>13} {one:8.1f} {many:8.1f} {many / one:6.2f} {many - one:8.1f}")
    sharded.close()
    ray.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps({"num_shards": args.num_shards, "context": args.context,
                                               "threads": args.threads, "results": results}, indent=1))


if __name__ == "__main__":
    main()
