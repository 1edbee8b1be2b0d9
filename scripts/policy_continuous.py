"""Block policies under continuous batching, in one process and in lockstep: each variant has an engine of
its own (the same model weights) and its own queue of the load test's conversations (64 greedy tokens per
reply), `--batch` users in each: a user's next request joins as soon as its last one finishes, a server
replica with that many steady users. With `--turns first` a user sends each conversation's first request
only; with `--turns all` every turn, the replies so far in its history (an agent's second request carries
its reply and the tool's observation), as the load test's users do. The engines take turns step by step,
in reverse order every other round: a slow spell of the shared host then hits every variant alike. Run one
after another, the same work was not comparable: block-1 steps took 45.8 ms in one variant's run and
72.3 ms in a run minutes later (agent, batch 4).

Each variant's figure is output tokens per second of its own engine's time (prefills included). Prints,
per scenario and batch, every variant and the adaptive ones over the best fixed block (b2 and up: the
load test's comparison) and over b1 (no drafting); with --out, writes report.md, report.json and a plot.
With `--repeats N` a cell runs N times, each time on `--prompts` conversations of its own (the next ones
of the scenario): the figures are pooled over the repeats (tokens over seconds), the best fixed block is
the best pooled one (not the luckiest of one run), and each repeat's adaptive / that block is listed, so
a cell's spread shows next to its ratio.

    .venv/bin/python scripts/policy_continuous.py --scenario chat,rag,agent --batch 1,4,16 --prompts 32 \\
        --max-block 4 --variants b1,b2,b4,adaptive --out docs/loadtest/lockstep
"""

import argparse
import collections
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.cli import comma_list  # noqa: E402
from engine.engine import Engine, SamplingParams  # noqa: E402
from engine.loading import load, stop_token_ids  # noqa: E402
from engine.policy import AdaptiveBlockPolicy, FixedBlockPolicy  # noqa: E402
from engine.prompts import Message, Prompt  # noqa: E402
from loadtest.run import fmt, geomean_interval  # noqa: E402
from loadtest.scenarios import conversations  # noqa: E402

SCENARIOS = ("chat", "rag", "agent")
MAX_LEN, MAX_TOKENS = 2048, 64  # the load test server's context; tokens per reply
PADDED = "-padded"  # a variant's suffix: its engine pads every drafter backlog into the block pass (the engine before stop 21)


class Lane:
    """One variant's engine, its queue of conversations (a user holds one at a time: its next turn, with the
    reply to the last in the history, joins as soon as that reply is done) and the engine time it has used.
    `replies` is shared by the lanes: a turn's reply in the history is the one the first lane to finish that
    turn generated, so every lane sends the same requests. (Greedy outputs can differ between variants in
    the last bits of a batched verify's logits; with each lane's own replies in its history the workloads
    drifted apart: stop 23's agent run at batch 16 generated 1,895 tokens in b4's lane, 1,751 in b2's.)"""

    def __init__(self, loaded, policy, conversations, batch, max_block, replies: dict):
        drafter = None if policy is None else loaded.drafter  # ar: an engine without a drafter (no target features)
        self.engine = Engine(loaded.target, drafter, max_slots=batch, max_len=MAX_LEN, policy=policy,
                             stop_token_ids=stop_token_ids(loaded.target_path))
        self.tokenizer, self.batch, self.max_block, self.seconds = loaded.tokenizer, batch, max_block, 0.0
        self.replies = replies  # (conversation, turns to come after the reply) -> the reply's text
        self.queue = [(c, list(turns), []) for c, turns in enumerate(conversations)]  # (conversation, turns to come, history)
        self.users, self.done = [], []  # (request, conversation, turns to come, history) running; every request made

    @property
    def finished(self):
        return not self.queue and not self.users

    def step(self):
        for user in [u for u in self.users if u[0].finished]:
            self.users.remove(user)
            request, conversation, turns, history = user
            if turns:  # the same user goes on at once: the turn's reply, then its next turn
                text = self.replies.setdefault((conversation, len(turns)), self.tokenizer.decode(
                    request.output_ids, skip_special_tokens=True))
                self.queue.insert(0, (conversation, turns, history + [Message(role="assistant", content=text)]))
        admit = []
        while self.queue and len(self.users) + len(admit) < self.batch:
            conversation, turns, history = self.queue.pop(0)
            history = history + turns[0]
            ids = Prompt(messages=history).token_ids(self.tokenizer)
            if len(ids) + MAX_TOKENS <= MAX_LEN:  # else the conversation ends (a server answers 400)
                admit.append((ids, conversation, turns[1:], history))
        start = time.perf_counter()
        for ids, conversation, turns, history in admit:
            request = self.engine.add_request(ids, SamplingParams(max_tokens=MAX_TOKENS, block_size=self.max_block))
            self.users.append((request, conversation, turns, history))
            self.done.append(request)
        if self.engine.num_running:
            self.engine.step()
        self.seconds += time.perf_counter() - start

    @property
    def num_finished(self):
        return len(self.done) - len(self.users)

    @property
    def tokens(self):
        return sum(len(r.output_ids) for r in self.done)


def run(loaded, policies: dict, conversations, batch, max_block=None, desc=None) -> dict:
    """{name: (engine seconds, output tokens, engine stats)} for every policy, the lanes stepped in lockstep;
    `max_block`: each request's block cap (a server's max_block_size; None: the drafter's block)."""
    replies = {}
    lanes = {name: Lane(loaded, policy, conversations, batch, max_block, replies) for name, policy in policies.items()}
    for name, lane in lanes.items():
        if name.endswith(PADDED):
            lane.engine.backlog_call_positions = None
    order = list(lanes.values())
    with tqdm(total=sum(map(len, conversations)) * len(lanes), desc=desc, unit="request", leave=False) as bar:
        while not all(lane.finished for lane in order):
            for lane in order:
                if not lane.finished:
                    lane.step()
            bar.update(sum(lane.num_finished for lane in order) - bar.n)
            order.reverse()
    return {name: (lane.seconds, lane.tokens, lane.engine.stats) for name, lane in lanes.items()}


def drafting_fixed(name) -> bool:
    """A fixed block of 2 or more on the current engine (b2, b4, ...): what adaptive is compared with."""
    return name.startswith("b") and name[1:].isdigit() and int(name[1:]) >= 2


def make_policy(name, profiled, baseline=None):
    """A variant's block policy; None for ar (the engine then has no drafter: the load test's AR server).
    `baseline`: a module with an AdaptiveBlockPolicy (another version of engine/policy.py) for the variant of that name."""
    name = name.removesuffix(PADDED)
    if name == "ar":
        return None
    if name == "baseline" and baseline is not None:
        return baseline.AdaptiveBlockPolicy(profiled.cost_model, profiled.block_sizes)
    if name.startswith("b") and name[1:].isdigit() and int(name[1:]) >= 1:
        return FixedBlockPolicy(int(name[1:]))
    if name in ("adaptive", "adaptive-notrim"):
        return AdaptiveBlockPolicy(profiled.cost_model, profiled.block_sizes, trim=name == "adaptive")
    raise ValueError(f"--variants: unknown variant {name!r} (ar, b<N>, adaptive, adaptive-notrim, baseline with --baseline; any but ar with {PADDED})")


def parse(description, batch, variants, variants_help, many=False):
    """The policy scripts' command line: scenario(s), batch(es), prompts, variants, dtype, largest block."""
    ap = argparse.ArgumentParser(description=description)
    if many:
        ap.add_argument("--scenario", type=comma_list(str), default=list(SCENARIOS), help="comma list of chat, rag, agent")
        ap.add_argument("--batch", type=comma_list(int), default=[batch], help="comma list: requests kept running")
    else:
        ap.add_argument("--scenario", default="chat", choices=SCENARIOS)
        ap.add_argument("--batch", type=int, default=batch, help="requests kept running")
    ap.add_argument("--prompts", type=int, default=48, help="conversations per scenario")
    ap.add_argument("--turns", default="first", choices=("first", "all"),
                    help="first: each conversation's first request; all: every turn, the replies in the history (the load test's users)")
    ap.add_argument("--variants", default=variants, help=variants_help)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-block", type=int, default=16, help="largest block (a server's max_block_size)")
    if many:
        ap.add_argument("--repeats", type=int, default=1, help="runs per cell, each on conversations of its own")
        ap.add_argument("--baseline", default=None, help="another version of engine/policy.py (e.g. `git show REV:engine/policy.py "
                        "> old.py`): its adaptive policy is the variant `baseline`, on the same cost table")
        ap.add_argument("--out", default=None, help="folder for report.md, report.json and lockstep.png")
    args = ap.parse_args()
    batches = args.batch if many else [args.batch]
    if min(batches, default=0) < 1 or args.prompts < 1 or args.max_block < 1 or getattr(args, "repeats", 1) < 1:
        ap.error("--batch, --prompts, --max-block and --repeats must be >= 1")
    if many and (not args.scenario or not set(args.scenario) <= set(SCENARIOS)):
        ap.error(f"--scenario: a comma list of {', '.join(SCENARIOS)}")
    return ap, args


def setup(args, scenarios=None):
    """The default model and drafter, each scenario's conversations (--turns) and a profiled adaptive policy."""
    torch.set_num_threads(1)
    loaded = load(None, "default", args.dtype, "cpu")
    batches = args.batch if isinstance(args.batch, list) else [args.batch]
    n = args.prompts * getattr(args, "repeats", 1)
    prompts = {s: [c if args.turns == "all" else c[:1] for c in conversations(s, n)]
               for s in (scenarios or [args.scenario])}
    profiled = AdaptiveBlockPolicy.profile(loaded.target, loaded.drafter, max_block_size=args.max_block,
                                           max_batch_size=max(max(batches), 2))
    return loaded, prompts, profiled


def markdown(results, args) -> str:
    fixed = [v for v in args.variants.split(",") if drafting_fixed(v)]
    what = "conversations, every turn" if args.turns == "all" else "prompts (first turns)"
    repeats = getattr(args, "repeats", 1)
    lines = [f"# Block policies in lockstep: {args.prompts} {what} per scenario" + (
             f", {repeats} repeats on conversations of their own" if repeats > 1 else "")
             + f", 64 greedy tokens, largest block {args.max_block}", "",
             "tok/s: output tokens per second of the variant's own engine time (pooled over the repeats); the engines "
             "take turns step by step.", "",
             "| scenario | batch | " + " | ".join(results[0]["tok_s"]) + " | adaptive / best fixed | by repeat | adaptive / b1 |",
             "|---|---|" + "---|" * (len(results[0]["tok_s"]) + 3)]
    for cell in results:
        rate = cell["tok_s"]
        lines.append(f"| {cell['scenario']} | {cell['batch']} | " + " | ".join(f"{r:.1f}" for r in rate.values())
                     + f" | {fmt(cell.get('adaptive_vs_best_fixed'), '.3f')} ({cell.get('best_fixed', '-')}) | "
                     + (", ".join(f"{r:.3f}" for r in cell.get("adaptive_vs_best_fixed_runs", [])) or "-")
                     + f" | {fmt(cell.get('adaptive_vs_b1'), '.3f')} |")
    if fixed:
        ratios = [r for c in results for r in c.get("adaptive_vs_best_fixed_runs", [])]
        ci = geomean_interval(ratios)
        lines += ["", f"Adaptive over the best fixed block ({', '.join(fixed)}), every repeat of every cell: geometric mean "
                      f"{ci['geomean']:.3f} (95% bootstrap interval {ci['low']:.3f}-{ci['high']:.3f}, {ci['n']} runs), "
                      f"lowest {min(ratios):.3f}, highest {max(ratios):.3f}."]
    return "\n".join(lines)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results[0]["tok_s"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        ax.bar([i + k * width for i in range(len(results))], [c["tok_s"][name] for c in results], width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))])
    ax.set_xticklabels([f"{c['scenario']}\nbatch {c['batch']}" for c in results])
    ax.set_ylabel("output tokens / s of engine time")
    ax.set_title("Block policies in lockstep (one process, the same prompts)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_cell(loaded, profiled, names, conversations, batch, args, scenario, baseline=None) -> dict:
    """One scenario at one batch, `args.repeats` times on conversations of its own: per variant the pooled
    tok/s (all tokens over all seconds) and each repeat's; the adaptive variant over the best pooled fixed
    block (b2 and up), pooled and by repeat, and over b1."""
    runs = []
    for r in range(args.repeats):
        part = conversations[r * args.prompts:(r + 1) * args.prompts]
        runs.append(run(loaded, {name: make_policy(name, profiled, baseline) for name in names}, part, batch, args.max_block,
                        desc=f"{scenario} batch {batch}" + (f" repeat {r + 1}/{args.repeats}" if args.repeats > 1 else "")))
    seconds = {k: sum(out[k][0] for out in runs) for k in names}
    rate = {k: sum(out[k][1] for out in runs) / seconds[k] for k in names}
    rows = {k: collections.Counter() for k in names}
    for out in runs:
        for k, (_, _, stats) in out.items():
            rows[k].update(stats.block_sizes)
    cell = {"scenario": scenario, "batch": batch, "tok_s": rate, "seconds": seconds,
            "tok_s_runs": {k: [out[k][1] / out[k][0] for out in runs] for k in names},
            "verified_rows_by_block": {k: dict(sorted(c.items())) for k, c in rows.items()}}
    fixed = [k for k in rate if drafting_fixed(k)]
    if "adaptive" in rate and fixed:
        best = cell["best_fixed"] = max(fixed, key=rate.get)
        cell["adaptive_vs_best_fixed"] = rate["adaptive"] / rate[best]
        cell["adaptive_vs_best_fixed_runs"] = [a / f for a, f in zip(cell["tok_s_runs"]["adaptive"], cell["tok_s_runs"][best])]
    if "adaptive" in rate and "b1" in rate:
        cell["adaptive_vs_b1"] = rate["adaptive"] / rate["b1"]
    return cell


def main():
    ap, args = parse(__doc__.split("\n")[0], 16, "b1,b2,b4,adaptive", f"comma list of ar, b<N>, adaptive, adaptive-notrim (with {PADDED}: backlogs padded into the block pass)",
                     many=True)
    names = args.variants.split(",")
    loaded, prompts, profiled = setup(args, args.scenario)
    baseline = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_policy", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    try:
        [make_policy(name, profiled, baseline) for name in names]
    except ValueError as e:
        ap.error(str(e))
    results = []
    for scenario in args.scenario:
        for batch in args.batch:
            results.append(cell := run_cell(loaded, profiled, names, prompts[scenario], batch, args, scenario, baseline))
            print(f"{scenario} batch {batch}: " + ", ".join(f"{k} {r:.1f} tok/s" for k, r in cell["tok_s"].items())
                  + (f"; adaptive / best fixed ({cell['best_fixed']}) {cell['adaptive_vs_best_fixed']:.3f}, by repeat "
                     + ", ".join(f"{r:.3f}" for r in cell["adaptive_vs_best_fixed_runs"]) if "best_fixed" in cell else "")
                  + f"; verified rows by block {cell['verified_rows_by_block']}", flush=True)
    report = markdown(results, args)
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
        (out / "report.md").write_text(report + "\n\n![lockstep](lockstep.png)\n")
        plot(results, out / "lockstep.png")


if __name__ == "__main__":
    main()
