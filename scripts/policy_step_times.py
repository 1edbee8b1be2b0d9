"""The adaptive policy's steps by kind, in one process: continuous batching as in scripts/policy_continuous.py
(one lane), with every decode step the engine reports to the policy sorted into block-1 steps, drafting steps
and drafter catch-ups (a drafting step after block-1 steps, when the drafter takes in their target features),
and the policy's own bookkeeping (choose, trim, observe_*) per step. Only steps at the full batch are shown.

    .venv/bin/python scripts/policy_step_times.py --scenario agent --batch 4 --prompts 24
"""

import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from policy_continuous import make_policy, parse, run, setup  # noqa: E402  (this folder: sys.path[0] as a script)

TIMED = ("choose", "trim", "observe_verified", "observe_step", "observe_gap")


def main():
    _, args = parse(__doc__.split("\n")[0], 4, "adaptive", "unused: always the adaptive policy")
    loaded, prompts, profiled = setup(args)
    policy = make_policy("adaptive", profiled)
    spent, steps = collections.Counter(), []
    for name in TIMED:
        def timed(*a, _call=getattr(policy, name), _name=name, **kw):
            start = time.perf_counter()
            out = _call(*a, **kw)
            spent[_name] += time.perf_counter() - start
            if _name == "observe_step":
                steps.append(a + tuple(kw.values()))
            return out
        setattr(policy, name, timed)
    run(loaded, {"adaptive": policy}, prompts[args.scenario], args.batch, args.max_block)
    kinds = collections.defaultdict(list)
    for batch, block, _context, seconds, _verified, caught_up in (s + (0,) * (6 - len(s)) for s in steps):
        if batch == args.batch:
            kind = "block 1" if block == 1 else "catch-up" if caught_up > 2 * block else "drafting"
            kinds[kind, block].append((seconds, caught_up))
    print(f"{args.scenario}, batch {args.batch}: steps at the full batch by kind")
    for (kind, block), group in sorted(kinds.items()):
        print(f"  {kind:>8}, block {block}: {len(group)} steps, median {1e3 * statistics.median(s for s, _ in group):.1f} ms, "
              f"{sum(s for s, _ in group):.2f} s in all, median positions caught up {statistics.median(c for _, c in group)}")
    print("policy bookkeeping per step (ms): " + ", ".join(f"{k} {1e3 * spent[k] / len(steps):.3f}" for k in TIMED))


if __name__ == "__main__":
    main()
