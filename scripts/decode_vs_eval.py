"""Does real decoding accept what the training's held-out evaluation says it would?

    python scripts/decode_vs_eval.py --held-out data/held-out --num-prompts 12

Decodes held-out prompts with the engine (greedy, one fixed block, full draft head) and, wherever its reply equals
the datagen reply, scores the same blocks (the engine's own anchors) with the training forward on
the stored target features. The two per-block accepted counts should agree; a systematic gap would
mean training and serving see different inputs. Also prints held-out tau per source (chat / code)
over whole replies and over their first --max-new-tokens tokens, the part a bench run decodes.
"""

import argparse
import copy

import torch

from engine.bench import BenchConfig, EngineSpec, make_engine
from engine.datagen import CODE_PROMPT
from engine.engine import SamplingParams
from engine.loading import DEFAULT_DRAFTER, load
from engine.train import Sequence, TrainConfig, evaluate, matched_drafts, setup


def first_tokens(s: Sequence, n: int) -> Sequence:
    """The sequence cut after its first n reply tokens."""
    end = s.prompt_len + n
    return Sequence(s.tokens[:end], s.prompt_len, s.features[:end], s.topk_ids[:end], s.topk_logp[:end])


def engine_blocks(r, prompt_len: int, matched: int, block: int) -> tuple[list[int], list[int]]:
    """The anchors (last committed token's position) and accepted drafts of the engine's steps whose
    whole block lies in the first `matched` reply tokens."""
    pos = prompt_len + 1  # the first reply token comes from prefill
    anchors, accepted = [], []
    for n in r.acceptance_lengths:
        if pos - 1 + block > prompt_len + matched:
            break
        anchors.append(pos - 1)
        accepted.append(n - 1)
        pos += n
    return anchors, accepted


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--held-out", required=True, help="datagen folder (held-out split)")
    ap.add_argument("--draft", default="default", help="drafter folder (default: the shipped one)")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    loaded = load(None, args.draft, args.dtype, "cpu")
    # the evaluation as training runs it: float32 weights under bf16 autocast where decoding is bf16
    draft = str(DEFAULT_DRAFTER) if args.draft == "default" else args.draft
    cfg = TrainConfig(data=args.held_out, held_out=args.held_out, out="-", init=draft, block_size=args.block_size,
                      bf16=loaded.dtype == torch.bfloat16)
    _, held, module, head, _, _ = setup(cfg)
    drafter, embed = module.drafter, module.embed
    print(f"{args.held_out}: made in {held.meta.get('dtype', 'an unrecorded dtype')}; decoding in {loaded.dtype}")

    engine = make_engine(loaded, EngineSpec(loaded.drafter, None, args.block_size), BenchConfig(full_draft_head=True), max_slots=1, max_len=2048)
    params = SamplingParams(max_tokens=args.max_new_tokens, block_size=args.block_size)
    blocks = equal = acc_engine = acc_eval = 0
    for i, s in enumerate(held.sequences[: args.num_prompts]):
        p = s.prompt_len
        r = engine.generate_batch([s.tokens[:p].tolist()], params)[0]
        ref = s.tokens[p:].tolist()
        matched = next((j for j, (a, b) in enumerate(zip(ref, r.output_ids)) if a != b), min(len(ref), len(r.output_ids)))
        anchors, by_engine = engine_blocks(r, p, matched, args.block_size)
        by_eval = matched_drafts(drafter, embed, head, s, torch.tensor(anchors), cfg)[0].sum(-1).tolist() if anchors else []
        blocks += len(anchors)
        equal += sum(a == b for a, b in zip(by_engine, by_eval))
        acc_engine, acc_eval = acc_engine + sum(by_engine), acc_eval + sum(by_eval)
        print(f"prompt {i}: reply matches datagen for {matched}/{len(r.output_ids)} tokens, {len(anchors)} blocks compared, "
              f"accepted {sum(by_engine)} decoding / {sum(by_eval)} evaluation")
    if blocks:
        print(f"{blocks} blocks: {equal} with the same accepted count; tau {1 + acc_engine / blocks:.3f} decoding, "
              f"{1 + acc_eval / blocks:.3f} evaluation")

    is_code = [CODE_PROMPT in loaded.tokenizer.decode(s.tokens[: s.prompt_len]) for s in held.sequences]
    n = args.max_new_tokens
    for name, want in (("chat", False), ("code", True)):
        part = copy.copy(held)
        part.sequences = [s for s, code in zip(held.sequences, is_code) if code == want]
        if not part.sequences:
            continue
        whole = evaluate(drafter, embed, head, part, cfg, None, max_blocks=10**9)["tau"]
        part.sequences = [first_tokens(s, n) for s in part.sequences]
        first = evaluate(drafter, embed, head, part, cfg, None, stride=1, max_blocks=10**9)["tau"]
        print(f"{name}: {len(part.sequences)} held-out replies, tau {whole:.3f} over whole replies (anchors every 16 "
              f"tokens), {first:.3f} over their first {n} tokens (every anchor)")


if __name__ == "__main__":
    main()
