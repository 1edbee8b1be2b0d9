"""Would verifying DFlash's block and the suffix draft in one pass, as two branches of a small tree, pay?

The measurement behind that design decision (docs/design.md). It runs greedy `dflash+suffix` one prompt
at a time, as `dflash-serve bench` does, with an engine whose drafter also drafts the rows that verify a
suffix draft, and records both drafts of every step. Greedy decoding makes each draft's accepted length
its common prefix with the output the request ended with. With step costs profiled on this machine
(batch 1: the tree's best case, since a wider verify costs more at larger batches), it estimates the
decode tokens/s, prompt by prompt, of three ways to spend each step the policy took:

- policy: what the engine verified (the adaptive policy's choice);
- best single: the draft that was accepted further, verified alone (the most any per-step choice gets);
- tree: both drafts in one verify of 1 + both widths, committing the longer accepted one; the drafter
  runs every step;
- copy ceiling: a drafter that knew, at every step, the longest span of the context (prompt and output so
  far) that the output goes on with, copied it (at most a block's worth) and verified exactly that: the
  most any drafting by copying could get, on its own walk through the output.

The estimates follow the steps the policy's run visited (a different choice would have led elsewhere)
and leave out prefill and the drafter's feature backlog after suffix steps (a tree drafts every step
and has none). Usage:

    python -m engine.branches --prompts data/prompts/agent.jsonl --num-prompts 8 --max-new-tokens 128
"""

import argparse
import statistics
from dataclasses import dataclass, replace

from tqdm import tqdm

from engine.config import EngineConfig, build_engine, load_models
from engine.engine import DraftBlock, Engine, SamplingParams
from engine.policy import CostModel
from engine.prompts import read_prompts
from engine.suffix import SuffixProposer

VERIFY_WIDTHS = (1, 2, 4, 8, 16, 24, 33)  # a tree verifies up to 1 + 16 + 16 positions


@dataclass
class Step:
    position: int  # output tokens committed before the step: drafts guess output[position:]
    dflash: list[int]  # the drafter's drafts (trimmed as the policy trims them)
    drafted: int  # the drafter pass's block (last token + masks)
    suffix: list[int]  # the suffix proposal: what the policy verified of it, else as much as fits the block
    chose_suffix: bool


class RecordingEngine(Engine):
    """The engine, unchanged in what it verifies, with a second drafter pass each step for the rows that
    verify a suffix draft; `steps[request_id]` lists what each step could have verified."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps: dict[int, list[Step]] = {}
        self._drafted: list[int] = []  # the last drafter pass's block per row

    def with_suffix(self, requests, rows, draft: DraftBlock, proposals, widths) -> DraftBlock:
        caps = [self.block_cap(r) for r in requests]
        others = [i for i, w in enumerate(widths) if w]  # rows verifying a suffix draft: drafted here too
        blocks = {i: (draft.block_ids[j, 1: draft.block_sizes[j]].tolist(), self._drafted[j])
                  for j, i in enumerate(rows)}
        if others:
            reqs = [requests[i] for i in others]
            sizes = self.policy.choose(reqs, [caps[i] for i in others])
            extra = self.trim(reqs, self.draft(reqs, sizes))
            blocks |= {i: (extra.block_ids[j, 1: extra.block_sizes[j]].tolist(), sizes[j])
                       for j, i in enumerate(others)}
        for i, r in enumerate(requests):
            p = proposals[i]
            suffix = [] if p is None else p.token_ids[: widths[i] or caps[i] - 1]
            self.steps.setdefault(r.request_id, []).append(
                Step(len(r.output_ids), *blocks[i], suffix, chose_suffix=widths[i] > 0))
        return super().with_suffix(requests, rows, draft, proposals, widths)

    def draft(self, requests, block_sizes) -> DraftBlock:
        self._drafted = list(block_sizes)
        return super().draft(requests, block_sizes)


def accepted(draft: list[int], output: list[int], position: int) -> int:
    """How many of `draft` greedy verification accepts: its common prefix with the output from `position`."""
    n = 0
    while n < len(draft) and position + n < len(output) and draft[n] == output[position + n]:
        n += 1
    return n


def longest_copy(context: list[int], output: list[int], position: int, limit: int) -> int:
    """The most tokens (<= limit) of output[position:] found in a row anywhere in `context`."""
    if limit < 1:
        return 0
    best = 0
    for i, token in enumerate(context):
        if token == output[position]:
            n = 1
            while n < limit and i + n < len(context) and position + n < len(output) and context[i + n] == output[position + n]:
                n += 1
            best = max(best, n)
    return best


def copy_walk(prompt: list[int], output: list[int], limit: int = 15) -> list[int]:
    """The copy ceiling's steps: how many tokens each step copies (then the target adds one)."""
    copied, position = [], 0
    while position < len(output):
        n = longest_copy(prompt + output[:position], output, position, min(limit, len(output) - position - 1))
        copied.append(n)
        position += n + 1
    return copied


def estimate(steps: list[Step], output: list[int], costs: CostModel, context: int,
             copied: list[int] = ()) -> dict[str, float]:
    """Decode tokens/s of the policy, the best single draft and the two-branch tree over `steps`, the copy
    ceiling's (given its walk, copy_walk) and plain decoding's."""
    verify = lambda width: costs.verify_cost(1, width, context)
    draft = lambda block: costs.draft_cost(1, block, context) if block > 1 else 0.0
    totals = {name: [0, 0.0] for name in ("policy", "best single", "tree", "copy ceiling", "ar")}

    def add(name, tokens, seconds):
        totals[name][0] += tokens
        totals[name][1] += seconds

    for s in steps:
        a_d, a_s = accepted(s.dflash, output, s.position), accepted(s.suffix, output, s.position)
        dflash_step = (a_d + 1, draft(s.drafted) + verify(len(s.dflash) + 1))
        suffix_step = (a_s + 1, verify(len(s.suffix) + 1))
        add("policy", *(suffix_step if s.chose_suffix else dflash_step))
        suffix_better = s.suffix and (a_s, -suffix_step[1]) > (a_d, -dflash_step[1])  # more tokens, then cheaper
        add("best single", *(suffix_step if suffix_better else dflash_step))
        tree_width = 1 + len(s.dflash) + len(s.suffix)
        add("tree", max(a_d, a_s) + 1, draft(s.drafted) + verify(tree_width))
    for n in copied:
        add("copy ceiling", n + 1, verify(n + 1))
    add("ar", len(output), len(output) * verify(1))
    return {name: tokens / seconds for name, (tokens, seconds) in totals.items() if seconds}


def run(prompts: str, num_prompts: int, max_new_tokens: int, engine_config: EngineConfig) -> list[dict]:
    loaded = load_models(engine_config)
    config = replace(engine_config, max_slots=1, policy="adaptive", proposers="dflash,suffix")
    base = build_engine(config, loaded)
    engine = RecordingEngine(
        base.target, base.drafter, max_slots=1, max_len=base.max_len, policy=base.policy,
        stop_token_ids=base.stop_token_ids, suffix=base.suffix)
    print("profiling verify widths", VERIFY_WIDTHS, "at batch 1")
    costs = CostModel.profile(loaded.target, loaded.drafter, batch_sizes=(1,), block_sizes=VERIFY_WIDTHS)
    rows = []
    for prompt in tqdm(read_prompts(prompts)[:num_prompts], desc="prompts"):
        ids = prompt.token_ids(loaded.tokenizer)
        engine.suffix, engine.steps = SuffixProposer(base.suffix.config), {}  # a fresh index, as bench's runs
        r = engine.generate_batch([ids], SamplingParams(max_tokens=max_new_tokens))[0]
        steps = engine.steps[r.request_id]
        copied = copy_walk(ids, r.output_ids)
        est = estimate(steps, r.output_ids, costs, len(ids) + len(r.output_ids) // 2, copied)
        both = sum(1 for s in steps if s.suffix and s.dflash)
        rows.append(dict(est, steps=len(steps), both=both, tokens=len(r.output_ids),
                         suffix_steps=sum(s.chose_suffix for s in steps), copy_steps=len(copied)))
    return rows


def report(rows: list[dict]) -> str:
    lines = ["| prompt | tokens | steps | both drafts | suffix chosen | policy tok/s | best single | tree | "
             "best single / policy | tree / policy | copy ceiling: steps / tok/s | policy / ar | copy ceiling / ar |",
             "|" + "---|" * 13]
    for i, r in enumerate(rows):
        lines.append(f"| {i} | {r['tokens']} | {r['steps']} | {r['both']} | {r['suffix_steps']} | {r['policy']:.1f} | "
                     f"{r['best single']:.1f} | {r['tree']:.1f} | {r['best single'] / r['policy']:.2f} | "
                     f"{r['tree'] / r['policy']:.2f} | {r['copy_steps']} / {r['copy ceiling']:.1f} | "
                     f"{r['policy'] / r['ar']:.2f} | {r['copy ceiling'] / r['ar']:.2f} |")
    med = lambda key, over="policy": statistics.median(r[key] / r[over] for r in rows)
    tau = lambda steps: sum(r["tokens"] for r in rows) / sum(r[steps] for r in rows)
    lines.append(f"\nmedian over prompts: best single / policy {med('best single'):.2f}x, tree / policy {med('tree'):.2f}x; "
                 f"policy / ar {med('policy', 'ar'):.2f}x, copy ceiling / ar {med('copy ceiling', 'ar'):.2f}x "
                 f"(tokens a step: policy {tau('steps'):.2f}, copy ceiling {tau('copy_steps'):.2f}; decoding alone)")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True, help="JSONL prompt file (as dflash-serve bench --prompts)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("auto", "float32", "bfloat16"))
    args = parser.parse_args(argv)
    rows = run(args.prompts, args.num_prompts, args.max_new_tokens, EngineConfig(dtype=args.dtype))
    print(report(rows))


if __name__ == "__main__":
    main()
