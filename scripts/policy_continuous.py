"""Block policies under continuous batching, in one process: `--batch` requests kept running (a new
one joins as soon as one finishes, as in a server replica), the load test's chat or RAG prompts, 64
greedy tokens each; the variants run one after another on the same engine weights. Prints each
variant's wall time and tokens/s, and for the adaptive ones what they chose and verified.

    .venv/bin/python scripts/policy_continuous.py --scenario chat --batch 16 --prompts 48

The variants run one after another in one run. On a bf16 host, chat, 48 prompts: adaptive / b2 was
0.955 at batch 16 and 0.977 at batch 4, adaptive without the trim 0.966 and 0.977; on another bf16 host,
64 prompts at batch 16: adaptive 190.8 tok/s, b1 191.1, b2 164.5 (README, "Load tests").
"""

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.engine import Engine, SamplingParams  # noqa: E402
from engine.loading import load, stop_token_ids  # noqa: E402
from engine.policy import AdaptiveBlockPolicy, FixedBlockPolicy  # noqa: E402
from engine.prompts import chat  # noqa: E402
from loadtest.scenarios import first_turns  # noqa: E402


def run(loaded, policy, prompts, batch):
    """Wall seconds and output tokens for all prompts, `batch` at a time, refilled as requests finish."""
    engine = Engine(loaded.target, loaded.drafter, max_slots=batch, max_len=2048, policy=policy,
                    stop_token_ids=stop_token_ids(loaded.target_path))
    queue, done, start = list(prompts), [], time.perf_counter()
    while queue or engine.num_running:
        while queue and engine.num_running < batch:
            done.append(engine.add_request(queue.pop(0), SamplingParams(max_tokens=64)))
        engine.step()
    return time.perf_counter() - start, sum(len(r.output_ids) for r in done), engine.stats


def counting(choose, chosen: collections.Counter):
    """`choose`, counting the steps by the block it picks."""
    def wrapped(requests, caps):
        sizes = choose(requests, caps)
        chosen[max(sizes)] += 1
        return sizes
    return wrapped


def parse(description, batch, variants, variants_help):
    """The two policy scripts' command line: scenario, batch, prompts, variants, dtype."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--scenario", default="chat", choices=("chat", "rag"))
    ap.add_argument("--batch", type=int, default=batch, help="requests kept running")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--variants", default=variants, help=variants_help)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    if args.batch < 1 or args.prompts < 1:
        ap.error("--batch and --prompts must be >= 1")
    return ap, args


def setup(args):
    """The default model and drafter, the scenario's prompts as token ids, and a profiled adaptive policy."""
    torch.set_num_threads(1)
    loaded = load(None, "default", args.dtype, "cpu")
    prompts = [chat(t).token_ids(loaded.tokenizer) for t in first_turns(args.scenario, args.prompts)]
    return loaded, prompts, AdaptiveBlockPolicy.profile(loaded.target, loaded.drafter, max_batch_size=max(args.batch, 2))


def main():
    ap, args = parse(__doc__.split("\n")[0], 16, "b2,adaptive,adaptive-notrim", "comma list of b<N>, adaptive, adaptive-notrim")
    loaded, prompts, profiled = setup(args)
    for name in args.variants.split(","):
        if name.startswith("b") and name[1:].isdigit():
            policy = FixedBlockPolicy(int(name[1:]))
        elif name in ("adaptive", "adaptive-notrim"):
            policy = AdaptiveBlockPolicy(profiled.cost_model, profiled.block_sizes, trim=name == "adaptive")
        else:
            ap.error(f"--variants: unknown variant {name!r}")
        chosen = collections.Counter()
        if isinstance(policy, AdaptiveBlockPolicy):
            policy.choose = counting(policy.choose, chosen)
        seconds, tokens, stats = run(loaded, policy, prompts, args.batch)
        print(f"{args.scenario} batch {args.batch} {name}: {seconds:.1f} s, {tokens / seconds:.1f} tok/s; "
              f"verified rows by block {dict(sorted(stats.block_sizes.items()))}"
              + (f"; steps by chosen block {dict(sorted(chosen.items()))}" if chosen else ""))


if __name__ == "__main__":
    main()
