"""Prefill of long prompts: causal attention vs a mask, and a burst of prompts with grouped prefill.

1. One prefill call of `--batch` prompts of `--length` tokens with the causal path (engine/model.py,
   no mask) and with the masked path it replaced, alternating every repeat; median ms of each, ratio.
2. A burst: `--burst` prompts (lengths drawn around `--length`) arrive while 4 requests decode. With
   grouped prefill (Engine.step: groups of <= PREFILL_TOKEN_BUDGET padded positions, alternating with
   decode steps) and with one prefill of the whole burst (the budget set past the burst's size): the
   time until every new request has its first token, and the running requests' longest gap between
   tokens meanwhile.

    .venv/bin/python scripts/prefill_bench.py --length 700 --batch 4 --burst 16 --repeats 3
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import engine.engine as engine_module  # noqa: E402
import engine.model as model_module  # noqa: E402
from engine.engine import Engine, SamplingParams  # noqa: E402
from engine.loading import load  # noqa: E402


def prefill_ms(engine, prompts) -> float:
    requests = [engine.add_request(p, SamplingParams(max_tokens=4)) for p in prompts]
    start = time.perf_counter()
    engine.prefill(requests)
    elapsed = time.perf_counter() - start
    for r in requests:
        engine.release(r)
    return elapsed * 1e3


def burst(engine, running_prompts, burst_prompts) -> dict:
    """Decode 4 requests, then a burst arrives: steps until every burst request has a token."""
    running = [engine.add_request(p, SamplingParams(max_tokens=200)) for p in running_prompts]
    while not all(r.output_ids for r in running):
        engine.step()
    engine.step()
    new = [engine.add_request(p, SamplingParams(max_tokens=16)) for p in burst_prompts]
    start = last_token = time.perf_counter()
    longest_gap = 0.0
    while not all(r.output_ids for r in new):
        outputs = engine.step()
        now = time.perf_counter()
        if any(o.request_id in {r.request_id for r in running} for o in outputs):
            longest_gap, last_token = max(longest_gap, now - last_token), now
    all_first = time.perf_counter() - start
    longest_gap = max(longest_gap, time.perf_counter() - last_token)
    for r in running + new:
        engine.abort(r.request_id)
    engine.step()
    return {"all_first_token_s": all_first, "longest_gap_s": longest_gap}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=700, help="prompt tokens")
    parser.add_argument("--batch", type=int, default=4, help="prompts per prefill call in part 1")
    parser.add_argument("--burst", type=int, default=16, help="prompts arriving at once in part 2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load(dtype="bfloat16")
    slots = max(args.batch, args.burst + 4)
    engine = Engine(loaded.target, loaded.drafter, max_slots=slots, max_len=3 * args.length // 2 + 300)
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(100, 40000) for _ in range(n)]

    causal_check = model_module.is_prefix_prefill
    times = {"causal": [], "mask": []}
    prefill_ms(engine, [prompt(args.length)] * args.batch)  # warm-up
    for _ in range(args.repeats):
        for name in times:
            model_module.is_prefix_prefill = causal_check if name == "causal" else (lambda *a: False)
            times[name].append(prefill_ms(engine, [prompt(args.length)] * args.batch))
    model_module.is_prefix_prefill = causal_check
    causal, mask = (statistics.median(times[k]) for k in ("causal", "mask"))
    print(f"prefill {args.batch} x {args.length} tokens, {loaded.dtype}, {args.threads} thread(s), "
          f"median of {args.repeats}: causal {causal:.0f} ms, mask {mask:.0f} ms, mask / causal {mask / causal:.2f}x")

    budget = engine_module.PREFILL_TOKEN_BUDGET
    results = {"grouped": [], "all at once": []}
    for _ in range(args.repeats):
        lengths = [rng.randint(args.length // 2, args.length * 3 // 2) for _ in range(args.burst)]
        running = [prompt(64) for _ in range(4)]
        for name in results:
            engine_module.PREFILL_TOKEN_BUDGET = budget if name == "grouped" else 10**9
            results[name].append(burst(engine, running, [prompt(n) for n in lengths]))
    engine_module.PREFILL_TOKEN_BUDGET = budget
    print(f"burst of {args.burst} prompts of {args.length // 2}-{args.length * 3 // 2} tokens while 4 requests "
          f"decode (median of {args.repeats}):")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"  {name:>12}: every first token after {med['all_first_token_s']:.1f} s, "
              f"running requests' longest gap {med['longest_gap_s']:.1f} s")


if __name__ == "__main__":
    main()
