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

    .venv/bin/python scripts/policy_continuous.py --scenario chat,rag,agent --batch 1,4,16 --prompts 32 \\
        --max-block 4 --variants b1,b2,b4,adaptive --out docs/loadtest/lockstep
"""

import argparse
import json
import statistics
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
from loadtest.run import fmt  # noqa: E402
from loadtest.scenarios import conversations  # noqa: E402

SCENARIOS = ("chat", "rag", "agent")
MAX_LEN, MAX_TOKENS = 2048, 64  # the load test server's context; tokens per reply
PADDED = "-padded"  # a variant's suffix: its engine pads every drafter backlog into the block pass (the engine before stop 21)


class Lane:
    """One variant's engine, its queue of conversations (a user holds one at a time: its next turn, with the
    reply to the last in the history, joins as soon as that reply is done) and the engine time it has used."""

    def __init__(self, loaded, policy, conversations, batch, max_block):
        drafter = None if policy is None else loaded.drafter  # ar: an engine without a drafter (no target features)
        self.engine = Engine(loaded.target, drafter, max_slots=batch, max_len=MAX_LEN, policy=policy,
                             stop_token_ids=stop_token_ids(loaded.target_path))
        self.tokenizer, self.batch, self.max_block, self.seconds = loaded.tokenizer, batch, max_block, 0.0
        self.queue = [(list(turns), []) for turns in conversations]  # (turns to come, history)
        self.users, self.done = [], []  # (request, turns to come, history) running; every request made

    @property
    def finished(self):
        return not self.queue and not self.users

    def step(self):
        for user in [u for u in self.users if u[0].finished]:
            self.users.remove(user)
            request, turns, history = user
            if turns:  # the same user goes on at once: its reply, then its next turn
                reply = Message(role="assistant", content=self.tokenizer.decode(request.output_ids, skip_special_tokens=True))
                self.queue.insert(0, (turns, history + [reply]))
        admit = []
        while self.queue and len(self.users) + len(admit) < self.batch:
            turns, history = self.queue.pop(0)
            history = history + turns[0]
            ids = Prompt(messages=history).token_ids(self.tokenizer)
            if len(ids) + MAX_TOKENS <= MAX_LEN:  # else the conversation ends (a server answers 400)
                admit.append((ids, turns[1:], history))
        start = time.perf_counter()
        for ids, turns, history in admit:
            request = self.engine.add_request(ids, SamplingParams(max_tokens=MAX_TOKENS, block_size=self.max_block))
            self.users.append((request, turns, history))
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
    lanes = {name: Lane(loaded, policy, conversations, batch, max_block) for name, policy in policies.items()}
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


def make_policy(name, profiled):
    """A variant's block policy; None for ar (the engine then has no drafter: the load test's AR server)."""
    name = name.removesuffix(PADDED)
    if name == "ar":
        return None
    if name.startswith("b") and name[1:].isdigit() and int(name[1:]) >= 1:
        return FixedBlockPolicy(int(name[1:]))
    if name in ("adaptive", "adaptive-notrim"):
        return AdaptiveBlockPolicy(profiled.cost_model, profiled.block_sizes, trim=name == "adaptive")
    raise ValueError(f"--variants: unknown variant {name!r} (ar, b<N>, adaptive, adaptive-notrim; any but ar with {PADDED})")


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
        ap.add_argument("--out", default=None, help="folder for report.md, report.json and lockstep.png")
    args = ap.parse_args()
    batches = args.batch if many else [args.batch]
    if min(batches, default=0) < 1 or args.prompts < 1 or args.max_block < 1:
        ap.error("--batch, --prompts and --max-block must be >= 1")
    if many and (not args.scenario or not set(args.scenario) <= set(SCENARIOS)):
        ap.error(f"--scenario: a comma list of {', '.join(SCENARIOS)}")
    return ap, args


def setup(args, scenarios=None):
    """The default model and drafter, each scenario's conversations (--turns) and a profiled adaptive policy."""
    torch.set_num_threads(1)
    loaded = load(None, "default", args.dtype, "cpu")
    batches = args.batch if isinstance(args.batch, list) else [args.batch]
    prompts = {s: [c if args.turns == "all" else c[:1] for c in conversations(s, args.prompts)]
               for s in (scenarios or [args.scenario])}
    profiled = AdaptiveBlockPolicy.profile(loaded.target, loaded.drafter, max_block_size=args.max_block,
                                           max_batch_size=max(max(batches), 2))
    return loaded, prompts, profiled


def markdown(results, args) -> str:
    fixed = [v for v in args.variants.split(",") if v.startswith("b") and v != "b1" and not v.endswith(PADDED)]
    what = "conversations, every turn" if args.turns == "all" else "prompts (first turns)"
    lines = [f"# Block policies in lockstep: {args.prompts} {what} per scenario, 64 greedy tokens, largest block "
             f"{args.max_block}", "",
             "tok/s: output tokens per second of the variant's own engine time; the engines take turns step by step.", "",
             "| scenario | batch | " + " | ".join(results[0]["tok_s"]) + " | adaptive / best fixed | adaptive / b1 |",
             "|---|---|" + "---|" * (len(results[0]["tok_s"]) + 2)]
    for cell in results:
        rate = cell["tok_s"]
        lines.append(f"| {cell['scenario']} | {cell['batch']} | " + " | ".join(f"{r:.1f}" for r in rate.values())
                     + f" | {fmt(cell.get('adaptive_vs_best_fixed'), '.3f')} ({cell.get('best_fixed', '-')}) | "
                     + f"{fmt(cell.get('adaptive_vs_b1'), '.3f')} |")
    if fixed:
        ratios = [c["adaptive_vs_best_fixed"] for c in results if "adaptive_vs_best_fixed" in c]
        lines += ["", f"Adaptive over the best fixed block ({', '.join(fixed)}): geometric mean "
                      f"{statistics.geometric_mean(ratios):.3f}, lowest {min(ratios):.3f}, highest {max(ratios):.3f}."]
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


def main():
    ap, args = parse(__doc__.split("\n")[0], 16, "b1,b2,b4,adaptive", f"comma list of ar, b<N>, adaptive, adaptive-notrim (with {PADDED}: backlogs padded into the block pass)",
                     many=True)
    names = args.variants.split(",")
    loaded, prompts, profiled = setup(args, args.scenario)
    try:
        [make_policy(name, profiled) for name in names]
    except ValueError as e:
        ap.error(str(e))
    results = []
    for scenario in args.scenario:
        for batch in args.batch:
            out = run(loaded, {name: make_policy(name, profiled) for name in names}, prompts[scenario], batch,
                      args.max_block, desc=f"{scenario} batch {batch}")
            cell = {"scenario": scenario, "batch": batch, "tok_s": {k: t / s for k, (s, t, _) in out.items()},
                    "seconds": {k: s for k, (s, _, _) in out.items()},
                    "verified_rows_by_block": {k: dict(sorted(st.block_sizes.items())) for k, (_, _, st) in out.items()}}
            rate = cell["tok_s"]
            fixed = [k for k in rate if k.startswith("b") and k != "b1" and not k.endswith(PADDED)]
            if "adaptive" in rate and fixed:
                cell["best_fixed"] = max(fixed, key=rate.get)
                cell["adaptive_vs_best_fixed"] = rate["adaptive"] / rate[cell["best_fixed"]]
            if "adaptive" in rate and "b1" in rate:
                cell["adaptive_vs_b1"] = rate["adaptive"] / rate["b1"]
            results.append(cell)
            print(f"{scenario} batch {batch}: " + ", ".join(f"{k} {r:.1f} tok/s" for k, r in rate.items())
                  + (f"; adaptive / best fixed ({cell['best_fixed']}) {cell['adaptive_vs_best_fixed']:.3f}"
                     if "best_fixed" in cell else "")
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
