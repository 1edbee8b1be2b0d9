"""What the adaptive policy expects against what the engine gets, per decode step: continuous batching
as in scripts/policy_continuous.py, each variant (fixed blocks, adaptive) with an adaptive policy
shadowing it (it sees every step's drafts and wall time, as if it were choosing). Per block run, prints
committed tokens and milliseconds per step, real and predicted, and the policy's acceptance estimates
against the observed conditional acceptance. Only full-batch steps that are not a drafter catch-up
(after a prefill or block-1 steps) are counted: those are the steps the policy's estimates are for.

    .venv/bin/python scripts/policy_predictions.py --scenario chat --batch 4 --prompts 48 --variants b1,b2,b4,adaptive

A bias on either side shows as predicted / real far from 1 for the block the variant runs.
"""

import collections
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.policy import AdaptiveBlockPolicy, BlockPolicy  # noqa: E402
from policy_continuous import parse, run, setup  # noqa: E402  (this folder: sys.path[0] when run as a script)

BLOCKS = (1, 2, 3, 4, 8)


class Shadowed(BlockPolicy):
    """Runs `block` for every request (None: the shadow's own choices and trim) and records, per step,
    the shadow's predicted tokens and seconds at BLOCKS next to what the step really gave."""

    def __init__(self, block: int | None, shadow: AdaptiveBlockPolicy):
        self.block, self.shadow, self.steps, self.step = block, shadow, [], {}

    def choose(self, requests, caps):
        sizes = self.shadow.choose(requests, caps)  # also adds the requests' new drafts to its pool
        if self.block is not None:
            sizes = [min(self.block, cap) for cap in caps]
        self.step = {"block": max(sizes), "batch": len(caps), "predicted": self.shadow.outlook(requests, caps, BLOCKS),
                     "tokens": len(caps), "estimates": [self.shadow.acceptance(r, 3) for r in requests]}
        return sizes

    def trim(self, requests, block_sizes, confidence, context):
        if self.block is None:
            return self.shadow.trim(requests, block_sizes, confidence, context)
        return list(block_sizes)

    def observe_verified(self, requests, block_sizes, verified_sizes, confidence, num_accepted):
        self.shadow.observe_verified(requests, block_sizes, verified_sizes, confidence, num_accepted)
        self.step.update(tokens=sum(a + 1 for a in num_accepted), accepted=list(num_accepted))

    def observe_step(self, batch, block, context, seconds, verified=None, caught_up=0):
        self.shadow.observe_step(batch, block, context, seconds, verified, caught_up)
        self.step.update(seconds=seconds, caught_up=caught_up)
        self.steps.append(self.step)


def report(name, steps, batch):
    steady = [s for s in steps if s["batch"] == batch and s["caught_up"] <= 2 * s["block"]]
    by_block = collections.defaultdict(list)
    for s in steady:
        by_block[s["block"]].append(s)
    for b, group in sorted(by_block.items()):
        real_t, real_s = sum(s["tokens"] for s in group), sum(s["seconds"] for s in group)
        pred_t, pred_s = (sum(s["predicted"][b][i] for s in group) for i in (0, 1)) if b in BLOCKS else (0, 0)
        line = f"  block {b}: {len(group)} steps; tokens/step {real_t / len(group):.2f}"
        if b in BLOCKS:
            line += (f" (predicted {pred_t / len(group):.2f}), ms/step {1e3 * real_s / len(group):.1f} (predicted "
                     f"{1e3 * pred_s / len(group):.1f}); predicted / real tokens/s {pred_t / pred_s / (real_t / real_s):.3f}")
        print(line)
    if steady:
        rates = {b: sum(s["predicted"][b][0] for s in steady) / sum(s["predicted"][b][1] for s in steady) for b in BLOCKS}
        print("  predicted tokens/s over these steps by block: " + ", ".join(f"b{b} {r:.1f}" for b, r in rates.items()))
        estimates = [e for s in steady for e in s["estimates"]]
        print("  acceptance estimates, positions 1-3 (mean):", [round(statistics.mean(e[k] for e in estimates), 3) for k in range(3)])
        accepted = [a for s in steady if s["block"] >= 4 and "accepted" in s for a in s["accepted"]]
        reached = [sum(1 for a in accepted if a >= k) for k in range(4)]
        if reached[0]:
            print("  observed conditional acceptance at block >= 4, positions 1-3:",
                  [round(reached[k + 1] / reached[k], 3) if reached[k] else None for k in range(3)])


def main():
    ap, args = parse(__doc__.split("\n")[0], 4, "b1,b2,b4,adaptive", "comma list of b<N> and adaptive")
    loaded, prompts, profiled = setup(args)
    for name in args.variants.split(","):
        if name != "adaptive" and not (name.startswith("b") and name[1:].isdigit() and int(name[1:]) >= 1):
            ap.error(f"--variants: unknown variant {name!r}")
        policy = Shadowed(None if name == "adaptive" else int(name[1:]),
                          AdaptiveBlockPolicy(profiled.cost_model, profiled.block_sizes))
        seconds, tokens, _ = run(loaded, {name: policy}, prompts[args.scenario], args.batch, args.max_block)[name]
        print(f"{args.scenario} batch {args.batch} {name}: {seconds:.1f} s, {tokens / seconds:.1f} tok/s")
        report(name, policy.steps, args.batch)


if __name__ == "__main__":
    main()
