"""`dflash-serve lockstep`: block policies under continuous batching, in one process and in lockstep.

Each variant has an engine of its own (the same model weights) and its own queue of the load test's
conversations (greedy replies), `--batch` users in each: a user's next request joins as soon as its
last one finishes, as in a server replica with that many steady users. With `--turns first` a user sends
each conversation's first request only; with `--turns all` every turn, the replies so far in its history
(an agent's second request carries its reply and the tool's observation), as the load test's users do.
The engines take turns step by step, in reverse order every other round, so a slow spell of a shared
host hits every variant alike (run one after another, the same work was not comparable); it resolves
differences a Locust run cannot (docs/design.md).

Each variant's figure is output tokens per second of its own engine's time (prefills included), pooled
over `--repeats` runs on conversations of their own. It reports every variant, adaptive over the best
fixed block (b2 and up, the load test's comparison) per run, and adaptive over b1 (no drafting).
"""

import collections
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from engine.config import EngineConfig, build_engine, load_models
from engine.engine import SamplingParams
from engine.prompts import Message, Prompt
from engine.stats import geomean_interval
from loadtest.run import HYBRID, fmt
from loadtest.scenarios import conversations

SCENARIOS = ("chat", "rag", "agent")
MAX_LEN = 2048  # the load test's server context
NAMED = {"adaptive": "dflash", HYBRID: "dflash,suffix"}  # adaptive variants: their proposers


@dataclass
class LockstepConfig:
    scenarios: list[str] = field(default_factory=lambda: list(SCENARIOS))
    batch: list[int] = field(default_factory=lambda: [16])  # requests kept running per lane
    prompts: int = 48  # conversations per scenario and repeat
    turns: str = "first"  # first: each conversation's first request; all: every turn
    variants: list[str] = field(default_factory=lambda: ["b1", "b2", "b4", "adaptive"])
    max_block: int = 16  # every request's block cap (a server's largest block)
    max_tokens: int = 64  # per reply, greedy
    repeats: int = 1
    out: str | None = None  # folder for report.md, report.json and lockstep.png
    engine: EngineConfig = field(default_factory=EngineConfig)  # models and dtype; each lane sets its policy


def fixed_block(name: str) -> int | None:
    """N of a variant b<N>, else None."""
    return int(name[1:]) if name.startswith("b") and name[1:].isdigit() and int(name[1:]) >= 1 else None


def drafting_fixed(name: str) -> bool:
    """A fixed block of 2 or more (b2, b4, ...): what adaptive is compared with."""
    return (fixed_block(name) or 0) >= 2


def lane_config(cfg: LockstepConfig, name: str, batch: int) -> EngineConfig:
    """A variant's engine: ar without a drafter, b<N> a fixed block, adaptive the adaptive policy (DFlash
    drafts only, as the block variants), dflash+suffix the default engine (the adaptive policy with suffix drafts)."""
    engine = replace(cfg.engine, max_slots=batch, max_len=MAX_LEN, proposers="dflash")  # block policies compared
    if name == "ar":
        return replace(engine, draft="none", policy="fixed", block_size=None)
    if name in NAMED:
        return replace(engine, policy="adaptive", block_size=cfg.max_block, proposers=NAMED[name])
    return replace(engine, policy="fixed", block_size=fixed_block(name))


def check_config(cfg: LockstepConfig) -> str | None:
    unknown = [s for s in cfg.scenarios if s not in SCENARIOS]
    if unknown or not cfg.scenarios:
        return f"--scenarios: unknown or none: {', '.join(unknown) or '(empty)'}; choose from {', '.join(SCENARIOS)}"
    bad = [v for v in cfg.variants if v != "ar" and v not in NAMED and fixed_block(v) is None]
    if bad or not cfg.variants:
        return f"--variants: unknown or none: {', '.join(bad) or '(empty)'}; choose from ar, b<N>, {', '.join(NAMED)}"
    for name in ("batch", "prompts", "max_block", "max_tokens", "repeats"):
        values = getattr(cfg, name)
        if min(values if isinstance(values, list) else [values], default=0) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {values}"
    if cfg.turns not in ("first", "all"):
        return f"--turns must be first or all, got {cfg.turns}"
    if cfg.out is not None and not Path(cfg.out).resolve().parent.is_dir():
        return f"--out {cfg.out}: the folder {Path(cfg.out).resolve().parent} does not exist"
    return None


class Lane:
    """One variant's engine, its queue of conversations (a user holds one at a time: its next turn, with the
    reply to the last in the history, joins as soon as that reply is done) and the engine time it has used.
    `replies` is shared by the lanes: a turn's reply in the history is the one the first lane to finish that
    turn generated, so every lane sends the same requests (greedy outputs can differ between variants in
    the last bits of a batched verify's logits, and the workloads would drift apart)."""

    def __init__(self, engine, tokenizer, conversations, batch, max_block, max_tokens, replies: dict):
        self.engine, self.tokenizer, self.batch, self.seconds = engine, tokenizer, batch, 0.0
        self.params = SamplingParams(max_tokens=max_tokens, block_size=max_block)
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
            if len(ids) + self.params.max_tokens <= MAX_LEN:  # else the conversation ends (a server answers 400)
                admit.append((ids, conversation, turns[1:], history))
        self.engine.not_the_callers_time()  # the other lanes' steps since this lane's last one
        start = time.perf_counter()
        for ids, conversation, turns, history in admit:
            request = self.engine.add_request(ids, self.params)
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


def run_lanes(engines: dict, tokenizer, conversations, cfg: LockstepConfig, batch: int, desc=None) -> dict:
    """{name: (engine seconds, output tokens, engine stats)} for every engine, the lanes stepped in lockstep."""
    replies = {}
    lanes = {name: Lane(engine, tokenizer, conversations, batch, cfg.max_block, cfg.max_tokens, replies)
             for name, engine in engines.items()}
    order = list(lanes.values())
    with tqdm(total=sum(map(len, conversations)) * len(lanes), desc=desc, unit="request", leave=False) as bar:
        while not all(lane.finished for lane in order):
            for lane in order:
                if not lane.finished:
                    lane.step()
            bar.update(sum(lane.num_finished for lane in order) - bar.n)
            order.reverse()
    return {name: (lane.seconds, lane.tokens, lane.engine.stats) for name, lane in lanes.items()}


def run_cell(cfg: LockstepConfig, loaded, scenario: str, conversations, batch: int) -> dict:
    """One scenario at one batch, cfg.repeats times on conversations of its own: per variant the pooled
    tok/s (all tokens over all seconds) and each repeat's; adaptive over the best pooled fixed block (b2
    and up), pooled and by repeat, and over b1."""
    runs = []
    for r in range(cfg.repeats):
        part = conversations[r * cfg.prompts:(r + 1) * cfg.prompts]
        engines = {name: build_engine(lane_config(cfg, name, batch), loaded) for name in cfg.variants}
        desc = f"{scenario} batch {batch}" + (f" repeat {r + 1}/{cfg.repeats}" if cfg.repeats > 1 else "")
        runs.append(run_lanes(engines, loaded.tokenizer, part, cfg, batch, desc))
    names = cfg.variants
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
    if HYBRID in rate and "ar" in rate:
        cell["default_vs_ar"] = rate[HYBRID] / rate["ar"]
    return cell


def markdown(results: list[dict], cfg: LockstepConfig) -> str:
    what = "conversations, every turn" if cfg.turns == "all" else "prompts (first turns)"
    lines = [f"# Block policies in lockstep: {cfg.prompts} {what} per scenario" + (
             f", {cfg.repeats} repeats on conversations of their own" if cfg.repeats > 1 else "")
             + f", {cfg.max_tokens} greedy tokens, largest block {cfg.max_block}", "",
             "tok/s: output tokens per second of the variant's own engine time (pooled over the repeats); the engines "
             "take turns step by step.", "",
             "| scenario | batch | " + " | ".join(results[0]["tok_s"]) + " | adaptive / best fixed | by repeat | adaptive / b1 "
             f"| {HYBRID} / ar |", "|---|---|" + "---|" * (len(results[0]["tok_s"]) + 4)]
    for cell in results:
        lines.append(f"| {cell['scenario']} | {cell['batch']} | " + " | ".join(f"{r:.1f}" for r in cell["tok_s"].values())
                     + f" | {fmt(cell.get('adaptive_vs_best_fixed'), '.3f')} ({cell.get('best_fixed', '-')}) | "
                     + (", ".join(f"{r:.3f}" for r in cell.get("adaptive_vs_best_fixed_runs", [])) or "-")
                     + f" | {fmt(cell.get('adaptive_vs_b1'), '.3f')} | {fmt(cell.get('default_vs_ar'), '.3f')} |")
    ratios = [r for c in results for r in c.get("adaptive_vs_best_fixed_runs", [])]
    if ratios:
        ci = geomean_interval(ratios)
        fixed = [v for v in cfg.variants if drafting_fixed(v)]
        lines += ["", f"Adaptive over the best fixed block ({', '.join(fixed)}), every repeat of every cell: geometric mean "
                      f"{ci['geomean']:.3f} (95% bootstrap interval {ci['low']:.3f}-{ci['high']:.3f}, {ci['n']} runs), "
                      f"lowest {min(ratios):.3f}, highest {max(ratios):.3f}."]
    return "\n".join(lines)


def plot(results: list[dict], path: Path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(results[0]["tok_s"])
    fig = Figure(figsize=(9, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
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


def run(cfg: LockstepConfig) -> list[dict]:
    """Every scenario at every batch; prints each cell and the report, writes it to cfg.out."""
    problem = check_config(cfg)
    if problem:
        raise ValueError(problem)
    torch.set_num_threads(1)  # a replica's one thread
    loaded = load_models(cfg.engine)
    results = []
    for scenario in cfg.scenarios:
        held = [c if cfg.turns == "all" else c[:1] for c in conversations(scenario, cfg.prompts * cfg.repeats)]
        for batch in cfg.batch:
            results.append(cell := run_cell(cfg, loaded, scenario, held, batch))
            print(f"{scenario} batch {batch}: " + ", ".join(f"{k} {r:.1f} tok/s" for k, r in cell["tok_s"].items())
                  + (f"; adaptive / best fixed ({cell['best_fixed']}) {cell['adaptive_vs_best_fixed']:.3f}, by repeat "
                     + ", ".join(f"{r:.3f}" for r in cell["adaptive_vs_best_fixed_runs"]) if "best_fixed" in cell else "")
                  + f"; verified rows by block {cell['verified_rows_by_block']}", flush=True)
    report = markdown(results, cfg)
    print(report)
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps({"config": asdict(cfg), "results": results}, indent=1) + "\n")
        (out / "report.md").write_text(report + "\n\n![lockstep](lockstep.png)\n")
        plot(results, out / "lockstep.png")
    return results
