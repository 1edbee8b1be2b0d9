"""Block policies side by side at one request at a time, in one process (no server, less noise than a
load test): fixed blocks and the adaptive policy at several `request_drafts`, on the load test's chat and
RAG prompts, 64 greedy tokens each, the variants interleaved prompt by prompt (one torch thread, --dtype,
the default drafter). Prints tok/s and mean acceptance length per variant and each adaptive variant's
tok/s over the best fixed block's.

    .venv/bin/python scripts/policy_ab.py --prompts 8 --request-drafts 8,32,128
"""

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine.engine import Engine, SamplingParams  # noqa: E402
from engine.loading import load, stop_token_ids  # noqa: E402
from engine.policy import AdaptiveBlockPolicy, FixedBlockPolicy  # noqa: E402
from loadtest.scenarios import Retriever, SEED, chat_conversations, rag_items, stdlib_passages  # noqa: E402

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per scenario")
    ap.add_argument("--fixed", default="2,4", help="comma list of fixed block sizes")
    ap.add_argument("--request-drafts", default="8,32", help="comma list of AdaptiveBlockPolicy request_drafts")
    ap.add_argument("--max-block", type=int, default=8)
    ap.add_argument("--cost-table", help="a saved CostModel to use (default: profile one, ~25 s)")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16, float32 or auto (bf16 where it is native)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load(None, "default", args.dtype, "cpu")

    rag = rag_items(Retriever(stdlib_passages()), args.prompts, random.Random(SEED))
    texts = {"chat": [c[0] for c in chat_conversations()[: args.prompts]], "rag": [r["prompt"] for r in rag]}
    kw = dict(max_block_size=args.max_block, max_batch_size=4, path=args.cost_table)
    variants = {f"b{b}": FixedBlockPolicy(int(b)) for b in args.fixed.split(",")}
    adaptive = {f"adaptive-{m}": AdaptiveBlockPolicy.profile(loaded.target, loaded.drafter, request_drafts=int(m), **kw)
                for m in args.request_drafts.split(",")}
    variants.update(adaptive)
    engines = {k: Engine(loaded.target, loaded.drafter, max_slots=1, max_len=2048, policy=p,
                         stop_token_ids=stop_token_ids(loaded.target_path)) for k, p in variants.items()}
    tok = loaded.tokenizer
    for scenario, prompts in texts.items():
        totals = {k: [0.0, 0, 0] for k in engines}  # seconds, tokens, steps
        for text in tqdm(prompts, desc=scenario):
            chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
            ids = tok(chat)["input_ids"]
            for name, engine in engines.items():
                start = time.perf_counter()
                r = engine.generate_batch([ids], SamplingParams(max_tokens=64))[0]
                t = totals[name]
                t[0] += time.perf_counter() - start
                t[1] += len(r.output_ids) - 1  # the first token comes from the prefill
                t[2] += len(r.acceptance_lengths)
        rate = {k: t[1] / t[0] for k, t in totals.items()}
        best = max(v for k, v in rate.items() if k not in adaptive)
        print(f"{scenario}: " + ", ".join(f"{k} {rate[k]:.1f} tok/s (MAL {t[1] / max(t[2], 1):.2f})" for k, t in totals.items()))
        print(f"{scenario}: adaptive / best fixed " + ", ".join(f"{k} {rate[k] / best:.3f}" for k in adaptive))

if __name__ == "__main__":
    main()
