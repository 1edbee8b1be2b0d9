"""Block policies side by side in one process (no server, less noise than a load test): fixed blocks and
the adaptive policy with and without its confidence trim, on the load test's chat and RAG prompts, 64
greedy tokens each, `--batch` requests at a time, the variants interleaved group by group, after an
untimed warm-up pass in which the policies learn (one torch thread, --dtype, the default drafter). Prints tok/s and mean acceptance length per variant and each
adaptive variant's tok/s over the best fixed block's; --json writes them.

    .venv/bin/python scripts/policy_ab.py --prompts 8 --batch 1,4 --repeats 2
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine.engine import Engine, SamplingParams  # noqa: E402
from engine.loading import load, stop_token_ids  # noqa: E402
from engine.policy import AdaptiveBlockPolicy, FixedBlockPolicy  # noqa: E402
from loadtest.scenarios import first_turns  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per scenario")
    ap.add_argument("--batch", default="1", help="comma list of concurrent requests per run")
    ap.add_argument("--fixed", default="2,4", help="comma list of fixed block sizes")
    ap.add_argument("--request-drafts", type=int, default=32, help="AdaptiveBlockPolicy request_drafts")
    ap.add_argument("--max-block", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts (tok/s: the median pass)")
    ap.add_argument("--cost-table", help="a saved CostModel to use (default: profile one, ~25 s)")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16, float32 or auto (bf16 where it is native)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    if args.repeats < 1 or not all(b >= 1 for b in batches):
        ap.error("--repeats and --batch must be >= 1")
    torch.set_num_threads(1)
    loaded = load(None, "default", args.dtype, "cpu")
    tok = loaded.tokenizer

    texts = {s: first_turns(s, args.prompts) for s in ("chat", "rag")}
    kw = dict(max_block_size=args.max_block, max_batch_size=max(batches), path=args.cost_table,
              request_drafts=args.request_drafts)
    profiled = AdaptiveBlockPolicy.profile(loaded.target, loaded.drafter, **kw)
    results = {}
    for batch in batches:
        for scenario, prompts in texts.items():
            # fresh policies per run: what each learns stays in its run
            variants = {f"b{b}": lambda b=int(b): FixedBlockPolicy(b) for b in args.fixed.split(",")}
            variants["adaptive"] = lambda: AdaptiveBlockPolicy(profiled.cost_model, profiled.block_sizes,
                                                               request_drafts=args.request_drafts)
            variants["adaptive-notrim"] = lambda: AdaptiveBlockPolicy(profiled.cost_model, profiled.block_sizes,
                                                                      request_drafts=args.request_drafts, trim=False)
            ids = [p.token_ids(tok) for p in prompts]
            groups = [ids[i: i + batch] for i in range(0, len(ids), batch)]
            passes = {k: [] for k in variants}
            # one engine (and policy) per variant for all passes: the untimed first pass is the policies' warm-up,
            # as a server's policy has long learned by the time it is measured
            engines = {k: Engine(loaded.target, loaded.drafter, max_slots=batch, max_len=2048, policy=make(),
                                 stop_token_ids=stop_token_ids(loaded.target_path)) for k, make in variants.items()}
            for repeat in range(args.repeats + 1):
                totals = {k: [0.0, 0, 0] for k in engines}  # seconds, tokens, steps
                desc = f"{scenario} batch {batch} " + ("warm-up" if repeat == 0 else f"pass {repeat}")
                for group in tqdm(groups, desc=desc):
                    for name, engine in engines.items():
                        start = time.perf_counter()
                        done = engine.generate_batch(group, SamplingParams(max_tokens=64))
                        t = totals[name]
                        t[0] += time.perf_counter() - start
                        t[1] += sum(len(r.output_ids) - 1 for r in done)  # the first token comes from the prefill
                        t[2] += sum(len(r.acceptance_lengths) for r in done)
                for k, (seconds, tokens, steps) in totals.items():
                    if repeat > 0:
                        passes[k].append({"tok_s": tokens / seconds, "mal": tokens / max(steps, 1)})
            rate = {k: statistics.median(p["tok_s"] for p in v) for k, v in passes.items()}
            best_name = max((k for k in rate if k.startswith("b")), key=rate.get)
            results[f"{scenario} batch {batch}"] = {"tok_s": rate, "mal": {k: v[-1]["mal"] for k, v in passes.items()},
                                                    "best_fixed": best_name,
                                                    "vs_best_fixed": {k: rate[k] / rate[best_name] for k in rate}}
            print(f"{scenario}, batch {batch}: " + ", ".join(
                f"{k} {rate[k]:.1f} tok/s (MAL {passes[k][-1]['mal']:.2f})" for k in rate))
            print(f"{scenario}, batch {batch}: over the best fixed block ({best_name}): " + ", ".join(
                f"{k} {rate[k] / rate[best_name]:.3f}" for k in rate if k.startswith("adaptive")))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
