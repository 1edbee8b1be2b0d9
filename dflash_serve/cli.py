"""The `dflash-serve` command line: one argparse subcommand per job, every flag checked up front so
mistakes fail before any model loads.

It sits above engine/, deployments/, cluster/ and loadtest/ and is the only code that knows them all;
those that import Ray (or Locust) are imported when their command runs. The engine's flags are
EngineConfig's fields, train's TrainConfig's.
"""

import argparse
import dataclasses
import math
import sys
import time
import typing
from pathlib import Path

from engine import bench
from engine.config import EngineConfig, build_engine, choices_of, load_models
from engine.loading import check_device
from engine.prompts import PromptFileError, read_prompts
from engine.runtime import cap_matmul_caches

ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))


def comma_list(kind):
    def parse(text):
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}")

    parse.__name__ = f"{kind.__name__} list"
    return parse


def none_or(kind):
    """An argparse type: `kind`, or none (the field's None)."""
    def parse(text):
        return None if text.lower() in ("none", "null") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def add_engine_flags(p: argparse.ArgumentParser, exclude=(), only=None):
    """A flag per EngineConfig field (its default, help and choices), but those in `exclude` or not in `only`."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in exclude or (only is not None and f.name not in only):
            continue
        hint, text = hints[f.name], f.metadata["help"]
        if typing.get_origin(hint) in (list, tuple):  # e.g. tuple[str, ...]: a comma list
            item = typing.get_args(hint)[0]
            parse = comma_list(str if choices_of(item) else item)
            kind = (lambda text, parse=parse: tuple(parse(text))) if typing.get_origin(hint) is tuple else parse
            p.add_argument(flag(f.name), type=kind, default=f.default, help=f"{text} (comma list; default {f.default})")
        elif hint is bool:
            p.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=f.default, help=text)
        elif choices_of(hint):
            p.add_argument(flag(f.name), choices=choices_of(hint), default=f.default, help=f"{text} (default {f.default})")
        else:
            kinds = typing.get_args(hint) or (hint,)  # (int, NoneType) for `int | None`
            kind = next(t for t in kinds if t is not type(None))
            shown = "" if f.default is None else f" (default {f.default})"
            p.add_argument(flag(f.name), type=none_or(kind) if type(None) in kinds else kind, default=f.default,
                           help=text + shown)


def engine_config(args, **overrides) -> EngineConfig:
    """The EngineConfig of the engine flags in `args` (the rest keep EngineConfig's defaults)."""
    given = {name: getattr(args, name) for name in ENGINE_FIELDS if hasattr(args, name)}
    return EngineConfig(**{**given, **overrides})


def flagged(message: str) -> str:
    """An EngineConfig error that starts with a field's name, starting with its flag instead."""
    name = next((n for n in ENGINE_FIELDS if message.startswith(n + " ")), None)
    return message if name is None else flag(name) + message[len(name):]


def add_sampling_flags(p: argparse.ArgumentParser, max_new_tokens: int):
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables it")
    p.add_argument("--seed", type=int, default=0)


TRAIN_HELP = {
    "data": "datagen folder to train on (several: comma-separated)",
    "out": "run folder: checkpoint.pt, log.jsonl, curves.png and the drafter (z-lab format) in drafter/",
    "held_out": "datagen folder (held-out split) for tau evaluations, or default: the committed held-out prompts (made on first use)",
    "target": "target checkpoint folder (default: the one the data was made with)",
    "num_layers": "draft layers",
    "mask_token_id": "mask token id (default: 16 for SmolLM2)",
    "feature_layers": "target layers the drafter reads (default: all the data has)",
    "init": "random; target: draft layers start as copies of the target's last layers; or a drafter folder to go on training (its weights and draft vocabulary)",
    "feature_norm": "divide features by their per-channel RMS (folded into fc when saving)",
    "vocab_subset": "train the head over the N most frequent tokens only; 0 = all",
    "distill": "weight of the target's top-k distribution in the loss",
    "anchors": "blocks per sequence per step",
    "seqs_per_step": "sequences per step",
    "cpu_minutes": "stop after this much process CPU time (the lr schedule follows it); 0 = use --steps",
    "device": "cpu or cuda[:N] (the data stays in host memory)",
    "bf16": "bf16 autocast (default: where the CPU has native bf16, AVX512-BF16 or AMX; elsewhere bf16 matmuls are emulated, ~20x slower)",
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="dflash-serve", description="DFlash speculative decoding engine")
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = subs.add_parser("generate", help="stream one completion to stdout, stats to stderr")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="tokenise the prompt as is, without the chat template")
    add_sampling_flags(gen, max_new_tokens=128)
    add_engine_flags(gen, exclude=("max_slots",))

    b = subs.add_parser("bench", help="compare decoding methods side by side on the same prompts")
    b.add_argument("--methods", type=comma_list(str), default=list(bench.METHODS), help=f"comma list of {', '.join(bench.METHODS)}")
    b.add_argument("--block-sizes", type=comma_list(int), default=[], help="also run dflash at these fixed blocks (dflash-b{N})")
    b.add_argument("--prompts", default=None,
                   help='JSONL file, one {"prompt": ...} or {"messages": [...]} per line (other keys are ignored)')
    b.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    b.add_argument("--batch-size", type=int, default=None, help="also time N concurrent requests in one engine")
    b.add_argument("--repeats", type=int, default=1, help="run the whole sweep N times, keep each run's fastest time")
    b.add_argument("--json", default=None, metavar="PATH")
    b.add_argument("--plot", default=None, metavar="PATH.png")
    add_sampling_flags(b, max_new_tokens=64)
    b.add_argument("--unseeded", action="store_true",
                   help="sampled requests carry no seed, as a server's usually do: verified by rejection sampling, "
                        "not exact match, and each method's output differs")
    add_engine_flags(b, exclude=("policy", "max_slots", "max_len"))  # each method sets them

    s = subs.add_parser("bench-serve", help="the HTTP server under a concurrency sweep: speculation on, off, in-process")
    s.add_argument("--concurrency", type=comma_list(int), default=[1, 2, 4, 8], help="comma list of concurrent clients")
    s.add_argument("--num-requests", type=int, default=8, help="requests per concurrency level and variant")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--variants", type=comma_list(str), default=["server", "server-nospec", "in-process"],
                   help="comma list of server (colocated), server-disagg (disaggregated), server-nospec, in-process")
    s.add_argument("--num-prompts", type=int, default=None, help="cycle through the first N built-in prompts")
    s.add_argument("--url", default=None, help="attach to a running server (http://127.0.0.1:PORT) instead of starting one")
    s.add_argument("--num-cpus", type=float, default=1.0, help="CPUs (and torch threads) per engine replica")
    s.add_argument("--max-slots", type=int, default=None, help="KV slots per replica (default: the largest concurrency)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0, help="0 disables it")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", default=None, metavar="PATH")
    s.add_argument("--plot", default=None, metavar="PATH.png")
    add_engine_flags(s, exclude=("max_slots",))

    srv = subs.add_parser("serve", help="start the OpenAI-compatible server on a local loopback Ray cluster")
    srv.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1")
    srv.add_argument("--num-replicas", type=int, default=1, help="engine replicas (1 CPU each)")
    srv.add_argument("--topology", default="colocated", choices=("colocated", "disaggregated"),
                     help="colocated: drafter and target in one replica; disaggregated: drafter and verifier "
                          "deployments behind a router")
    srv.add_argument("--num-shards", type=int, default=1,
                     help="pipeline shards of the target per replica (Ray actors, 1 CPU each)")
    srv.add_argument("--shard-placement", default="PACK", choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
                     help="placement group strategy of a replica and its shards")
    srv.add_argument("--api-key", action="append", default=[], metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on every route but /health (repeatable); "
                          "DFLASH_API_KEYS (a comma list) adds keys without showing them in the process list")
    srv.add_argument("--max-queued-requests", type=int, default=None,
                     help="requests waiting for a replica before new ones get 503 + Retry-After (-1: no limit; default 64)")
    srv.add_argument("--request-timeout-s", type=float, default=None,
                     help="longest a request may run before it is cancelled with 504 (default 600)")
    add_engine_flags(srv)

    dg = subs.add_parser("datagen", help="regenerate responses with the target and capture its features (drafter training data)")
    dg.add_argument("--out", default=None, help="data folder (resumed if it holds a partial run with the same settings)")
    dg.add_argument("--num-prompts", type=int, default=2048)
    dg.add_argument("--split", default="train", choices=("train", "held-out"))
    dg.add_argument("--sources", type=comma_list(str), default=["sharegpt", "code"], help="comma list of sharegpt, code, code-methods")
    dg.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts")
    dg.add_argument("--skip-prompts", type=int, default=0, help="start after the split's first N prompts (more data than an earlier folder)")
    dg.add_argument("--max-new-tokens", type=int, default=256)
    dg.add_argument("--batch-size", type=int, default=32, help="requests decoded together")
    dg.add_argument("--top-k", type=int, default=8, help="target log-probabilities kept per position (for distillation)")
    dg.add_argument("--feature-layers", type=comma_list(int), default=None, help="target layers to capture (default: 5 spread)")
    dg.add_argument("--prompts", default=None, metavar="PATH.jsonl",
                    help="a bench prompt file (your traffic's requests) instead of the split of --sources")
    dg.add_argument("--write-prompts", default=None, metavar="PATH.jsonl", help="only write the split's prompts (up to 600 characters) as a bench prompt file")
    dg.add_argument("--write-traffic-prompts", default=None, metavar="PATH.jsonl.xz",
                    help="only write --num-prompts RAG and as many agent requests of the load test's kind, none the "
                         "load test or the bench prompts ask (the agent's first reply is the target's, greedy)")
    add_engine_flags(dg, only=("target", "dtype", "device"))

    from engine.train import TrainConfig

    tr = subs.add_parser("train", help="train a DFlash drafter on datagen output (resumable; --workers N uses Ray Train)")
    for name, f in TrainConfig.__dataclass_fields__.items():
        default, text = f.default, TRAIN_HELP.get(name)
        if name in ("data", "out"):
            tr.add_argument(flag(name), required=True, help=text)
        elif isinstance(default, bool) or name == "bf16":
            tr.add_argument(flag(name), action=argparse.BooleanOptionalAction, default=default, help=text)
        elif name == "feature_layers":
            tr.add_argument(flag(name), type=comma_list(int), default=None, help=text)
        elif name in ("held_out", "target"):
            tr.add_argument(flag(name), default=None, help=text)
        elif name == "mask_token_id":
            tr.add_argument(flag(name), type=int, default=None, help=text)
        else:
            tr.add_argument(flag(name), type=type(default), default=default, help=f"{text or ''} (default {default})".strip())
    tr.add_argument("--resume", action="store_true", help="continue the run in --out")
    tr.add_argument("--workers", type=int, default=1, help="data-parallel workers (> 1: Ray Train on a loopback cluster)")

    tc = subs.add_parser("train-curves", help="held-out tau against training CPU time for several runs, side by side")
    tc.add_argument("runs", nargs="+", metavar="LABEL=PATH",
                    help="a run's log.jsonl or evals.json; LABEL=PATH1+PATH2 chains a run and one started from its drafter")
    tc.add_argument("--out", required=True, help="folder for curves.md and curves.png")
    tc.add_argument("--points", type=comma_list(float), default=[10, 20, 30, 40, 50, 60, 80, 100, 120],
                    help="CPU-minutes to tabulate")
    tc.add_argument("--project", type=comma_list(float), default=[], metavar="TAUS",
                    help="comma list of tau targets: fit the last run's curve (tau - 1 as a power of CPU time) "
                         "and say when it would reach them")
    tc.add_argument("--fit-from", type=float, default=20.0, help="CPU-minutes where that fit starts")

    ev = subs.add_parser("eval-drafter", help="a drafter's held-out greedy tau on chat and on code prompts")
    ev.add_argument("--held-out", default="default",
                    help="datagen folder of the held-out split (default: the committed held-out prompts, made on first use)")
    ev.add_argument("--json", default=None, metavar="PATH")
    add_engine_flags(ev, only=("target", "draft", "dtype"))

    from deployments import dashboards  # imports neither ray nor Grafana's libraries until it runs

    dash = subs.add_parser("dashboards", help="write the Grafana dashboard (and push it to a Grafana server)")
    dashboards.add_arguments(dash)
    pp = subs.add_parser("plot-panel", help="draw a dashboard panel from Prometheus as a PNG (what Grafana shows)")
    dashboards.add_plot_arguments(pp)
    lt = subs.add_parser("loadtest", help="Locust chat/RAG/agent load: speculation on vs off, fixed vs adaptive blocks")
    lt.add_argument("--scenarios", type=comma_list(str), default=["chat", "rag", "agent"], help="comma list of chat, rag, agent")
    lt.add_argument("--users", type=comma_list(int), default=[1, 4, 16], help="comma list of concurrent users")
    lt.add_argument("--variants", type=comma_list(str), default=["ar", "b2", "b3", "b4", "adaptive", "dflash+suffix"],
                    help="comma list of ar (no drafter), b<N> (fixed block N), adaptive (DFlash drafts only), "
                         "dflash+suffix (suffix drafting beside DFlash)")
    lt.add_argument("--run-time", type=float, default=30.0, help="seconds of load per scenario, user count and variant")
    lt.add_argument("--max-requests", type=int, default=500, help="requests per run at most")
    lt.add_argument("--requests-per-user", type=int, default=0,
                    help="also stop a run after N requests per user: every variant serves the same requests (0: off)")
    lt.add_argument("--min-requests", type=int, default=0,
                    help="with --requests-per-user: a run serves at least this many requests (1 user: less noise)")
    lt.add_argument("--repeats", type=int, default=1, help="runs per scenario, user count and variant (median kept)")
    lt.add_argument("--max-tokens", type=int, default=64)
    lt.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    lt.add_argument("--shape", default="steady", choices=("steady", "poisson", "step"),
                    help="steady users, Poisson think times, or a step ramp up to --users")
    lt.add_argument("--think-time", type=float, default=2.0, help="--shape poisson: mean seconds between a user's requests")
    lt.add_argument("--url", default=None, help="load a running server (http://127.0.0.1:PORT) instead of deploying the variants")
    lt.add_argument("--max-slots", type=int, default=None, help="KV slots per replica (default: the largest --users)")
    lt.add_argument("--out", default="loadtest-report", help="folder for the report, plots, Locust CSVs and logs")
    lt.add_argument("--seed", type=int, default=0)
    lt.add_argument("--resume", action="store_true",
                    help="keep the runs already in --out/runs (same flags): an interrupted sweep goes on where it stopped")
    add_engine_flags(lt, only=("target", "draft", "dtype"))

    lk = subs.add_parser("lockstep", help="block policies side by side in one process under continuous batching "
                                          "(the load test's conversations, the engines taking turns step by step)")
    lk.add_argument("--scenarios", type=comma_list(str), default=["chat", "rag", "agent"], help="comma list of chat, rag, agent")
    lk.add_argument("--batch", type=comma_list(int), default=[16], help="comma list: requests kept running per engine")
    lk.add_argument("--prompts", type=int, default=48, help="conversations per scenario and repeat")
    lk.add_argument("--turns", default="first", choices=("first", "all"),
                    help="first: each conversation's first request; all: every turn, the replies in the history")
    lk.add_argument("--variants", type=comma_list(str), default=["b1", "b2", "b4", "adaptive"],
                    help="comma list of ar (no drafter), b<N> (fixed block N), adaptive (DFlash drafts only), "
                         "dflash+suffix (the default engine)")
    lk.add_argument("--max-block", type=int, default=16, help="every request's largest block (a server's)")
    lk.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per reply")
    lk.add_argument("--repeats", type=int, default=1, help="runs per cell, each on conversations of its own")
    lk.add_argument("--out", default=None, help="folder for report.md, report.json and lockstep.png")
    add_engine_flags(lk, only=("target", "draft", "dtype"))

    sk = subs.add_parser("soak", help="mixed chat/RAG/agent load for a bounded time: replica memory and KV slots stay flat?")
    sk.add_argument("--minutes", type=float, default=10.0, help="minutes of load")
    sk.add_argument("--users", type=int, default=12, help="concurrent users, chat, RAG and agent in equal parts")
    sk.add_argument("--max-tokens", type=int, default=64)
    sk.add_argument("--sample-every", type=float, default=10.0, help="seconds between memory and slot samples")
    sk.add_argument("--out", default="soak-report", help="folder for soak.md, soak.json, soak.png and Locust's files")
    add_engine_flags(sk, only=("policy", "max_slots", "suffix_index_tokens"))
    return parser, {"generate": gen, "bench": b, "bench-serve": s, "serve": srv, "datagen": dg, "train": tr,
                    "train-curves": tc, "eval-drafter": ev, "dashboards": dash, "plot-panel": pp, "loadtest": lt, "lockstep": lk, "soak": sk}


# ---- validation -----------------------------------------------------------------------------

RANGES = [  # (dest, ok, what) for every subcommand that has the flag; None means "not given"
    ("max_new_tokens", lambda v: v > 0, "must be > 0"),
    ("temperature", lambda v: v >= 0 and not math.isinf(v), "must be >= 0"),
    ("top_p", lambda v: 0 < v <= 1, "must be in (0, 1]"),
    ("top_k", lambda v: v >= 0, "must be >= 0 (0 disables it)"),
    ("num_prompts", lambda v: v is None or v >= 1, "must be >= 1"),
    ("batch_size", lambda v: v is None or v >= 1, "must be >= 1"),
    ("repeats", lambda v: v >= 1, "must be >= 1"),
    ("port", lambda v: v is None or 0 < v < 65536, "must be a TCP port (1-65535)"),
    ("max_slots", lambda v: v is None or v >= 1, "must be >= 1"),
    ("num_replicas", lambda v: v is None or v >= 1, "must be >= 1"),
    ("num_shards", lambda v: v >= 1, "must be >= 1"),
    ("max_prompt_tokens", lambda v: v >= 1, "must be >= 1"),
    ("workers", lambda v: v >= 1, "must be >= 1"),
]


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check(args, parser: argparse.ArgumentParser):
    """Every problem that can be seen without loading a model, as an argparse error naming the flag."""
    for dest, ok, what in RANGES:
        if hasattr(args, dest) and not ok(getattr(args, dest)):
            parser.error(f"{flag(dest)} {what}, got {getattr(args, dest)}")
    if hasattr(args, "device"):
        try:
            check_device(args.device)  # here, not in EngineConfig: a cluster's head may have no GPU
        except ValueError as e:
            parser.error(str(e))
    if any(hasattr(args, name) for name in ENGINE_FIELDS):
        try:
            engine_config(args)
        except ValueError as e:
            parser.error(flagged(str(e)))
    if args.command == "datagen":
        if args.top_k < 1:
            parser.error(f"--top-k must be >= 1, got {args.top_k}")
        if args.out is None and not (args.write_prompts or args.write_traffic_prompts):
            parser.error("--out is required (the data folder)")
        if args.prompts:
            try:
                read_prompts(args.prompts)
            except PromptFileError as e:
                parser.error(f"--prompts: {e}")
    if args.command == "generate":
        if not args.prompt.strip():
            parser.error("--prompt must not be empty")
    elif args.command == "bench":
        check_bench(args, parser)


def check_bench(args, parser):
    unknown = [m for m in args.methods if m not in bench.METHODS]
    if unknown:
        parser.error(f"--methods: unknown method {', '.join(unknown)}; choose from {', '.join(bench.METHODS)}")
    if not args.methods and not args.block_sizes:
        parser.error("--methods must name at least one method")
    if any(b < 1 for b in args.block_sizes):
        parser.error(f"--block-sizes must all be >= 1, got {args.block_sizes}")
    needs = [m for m in args.methods if m in bench.NEEDS_DRAFTER] + [f"dflash-b{b}" for b in args.block_sizes]
    if args.draft == "none" and needs:
        parser.error(f"--draft none turns speculation off, which these methods need: {', '.join(needs)}")
    if args.prompts is not None:
        try:
            count = len(read_prompts(args.prompts))
        except PromptFileError as e:
            parser.error(f"--prompts {e}")
    else:
        count = len(bench.DEFAULT_PROMPTS)
    if args.num_prompts is not None and args.num_prompts > count:
        parser.error(f"--num-prompts {args.num_prompts}: there are only {count} prompts")
    for dest in ("json", "plot"):
        path = getattr(args, dest)
        if path is not None and not Path(path).resolve().parent.is_dir():
            parser.error(f"{flag(dest)} {path}: the folder {Path(path).resolve().parent} does not exist")
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        parser.error(f"--plot must be a .png path, got {args.plot}")


# ---- generate -------------------------------------------------------------------------------


class TextStream:
    """Incremental detokenisation: decode the whole output each time, print the new suffix once it
    does not end in U+FFFD (a multi-byte character still split across tokens)."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.printed = 0

    def add(self, ids: list[int]):
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if len(text) > self.printed and not text.endswith("\ufffd"):
            self.out.write(text[self.printed :])
            self.out.flush()
            self.printed = len(text)


def prompt_ids(tokenizer, prompt: str, raw: bool) -> list[int]:
    from engine.prompts import Prompt, chat

    return (Prompt(prompt=prompt) if raw else chat(prompt)).token_ids(tokenizer)


def cmd_generate(args):
    from engine.engine import SamplingParams

    config = engine_config(args, max_slots=1)
    loaded = load_models(config)
    engine = build_engine(config, loaded)
    ids = prompt_ids(loaded.tokenizer, args.prompt, args.raw)
    params = SamplingParams(
        max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, block_size=config.max_block_size(loaded.drafter),
    )
    stream, start, first = TextStream(loaded.tokenizer), time.perf_counter(), None
    for new in engine.generate(ids, params):
        first = first or time.perf_counter()
        stream.add(new)
    seconds = time.perf_counter() - start
    print()
    print_stats(engine, len(stream.ids), seconds, first - start if first else None)


def print_stats(engine, tokens: int, seconds: float, ttft: float | None):
    s = engine.stats
    lines = [f"tokens: {tokens} in {seconds:.2f} s ({tokens / seconds:.1f} tokens/s)"]
    if ttft is not None:
        lines.append(f"time to first token: {ttft:.3f} s")
    if engine.drafter is None:
        lines.append("mean acceptance length: n/a (no drafter)")
    else:
        per_pos = " ".join(f"{a:.2f}" for a in s.per_position_acceptance) or "-"
        lines.append(f"mean acceptance length: {s.mean_acceptance_length:.2f} over {s.num_drafts} drafts")
        lines.append(f"per-position acceptance: {per_pos}")
    print("\n".join(lines), file=sys.stderr)


# ---- bench ----------------------------------------------------------------------------------


def cmd_bench(args):
    fields = bench.BenchConfig.__dataclass_fields__
    bench.run(bench.BenchConfig(**{k: v for k, v in vars(args).items() if k in fields}, engine=engine_config(args)))


def run_checked(command: str, module, config_class, args):
    """The subcommands whose flags fill a config dataclass: build it, check it (an argparse error naming
    the flag), run it. `module` has check_config(cfg) and run(cfg)."""
    fields = config_class.__dataclass_fields__
    given = {k: v for k, v in vars(args).items() if k in fields}
    if "engine" in fields:
        given["engine"] = engine_config(args)
    cfg = config_class(**given)
    problem = module.check_config(cfg)
    if problem:
        build_parser()[1][command].error(problem)
    module.run(cfg)


def cmd_bench_serve(args):
    from deployments import bench_serve

    run_checked("bench-serve", bench_serve, bench_serve.ServeBenchConfig, args)


def serve_config(args):
    """The AppConfig of the `serve` flags (and DFLASH_API_KEYS); unset flags keep AppConfig's defaults."""
    from deployments.config import AppConfig, env_api_keys

    optional = {"max_queued_requests": args.max_queued_requests, "request_timeout_s": args.request_timeout_s}
    keys = [*args.api_key, *env_api_keys()]  # the replicas would read the environment too; this shows the count
    config = AppConfig(
        engine=engine_config(args), num_replicas=args.num_replicas, api_keys=keys, topology=args.topology,
        num_shards=args.num_shards, shard_placement=args.shard_placement,
        **{k: v for k, v in optional.items() if v is not None},
    )
    if config.num_shards > 1:
        from deployments.shards import check_num_shards

        check_num_shards(config)  # more shards than the target has layers: an error before Ray starts
    return config


def cmd_serve(args):
    from deployments import launch

    try:
        config = serve_config(args)
    except ValueError as e:  # pydantic's ValidationError names the field
        build_parser()[1]["serve"].error(str(e))
    launch.serve_forever(config, args.port)


def cmd_datagen(args):
    from engine import datagen

    if args.write_prompts:
        datagen.write_prompt_file(args.write_prompts, args.sources, args.split)
        return
    loaded = load_models(engine_config(args, draft="none"))
    if args.write_traffic_prompts:
        from engine.engine import Engine
        from engine.loading import stop_token_ids
        from engine.prompts import write_prompts
        from loadtest.scenarios import greedy_replies, training_prompts

        engine = Engine(loaded.target, None, max_slots=args.batch_size, max_len=2048,
                        stop_token_ids=stop_token_ids(loaded.target_path))
        write_prompts(args.write_traffic_prompts, training_prompts(args.num_prompts, greedy_replies(engine, loaded.tokenizer)))
        return
    datagen.generate_data(
        loaded, args.out, num_prompts=args.num_prompts, split=args.split, sources=args.sources,
        max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        top_k=args.top_k, feature_layers=args.feature_layers, skip_prompts=args.skip_prompts, prompt_file=args.prompts,
    )


def cmd_train(args):
    from engine.train import TrainConfig, train

    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__})
    cfg.check()
    out = Path(cfg.out)
    if out.exists() and any(out.iterdir()) and not args.resume:
        raise ValueError(f"--out {out} exists and is not empty; pass --resume to continue that run or choose another folder")
    if args.resume and not (out / "checkpoint.pt").exists():
        raise ValueError(f"--resume: {out} holds no checkpoint.pt to resume from")
    out.mkdir(parents=True, exist_ok=True)
    if args.workers > 1:
        from cluster import ray_train  # imports Ray when it runs

        result = ray_train.train_distributed(cfg, args.workers)
    else:
        result = train(cfg)
    print(f"held-out tau {result.get('tau', float('nan')):.3f} after {result['step']} steps; drafter in {out / 'drafter'}")


def cmd_train_curves(args):
    from engine import train_curves

    parser = build_parser()[1]["train-curves"]
    try:
        runs = train_curves.read_runs(args.runs)
    except ValueError as e:
        parser.error(str(e))
    try:
        print(train_curves.run(runs, Path(args.out), args.points, args.project, args.fit_from))
    except ValueError as e:  # too few evaluations to fit
        parser.error(f"--project: {e}")


def cmd_eval_drafter(args):
    import json

    from engine.train import evaluate_drafter

    if args.draft in ("random", "none"):
        raise ValueError("--draft must be a drafter folder or default")
    result = evaluate_drafter(args.draft, args.target, args.dtype, args.held_out)
    for kind, r in result.items():
        if isinstance(r, dict):  # a kind of prompt: chat (or the prompt file's name), code
            lo, hi = r["tau_ci"]
            print(f"{kind}: held-out tau {r['tau']:.3f} (95% over replies {lo:.3f}-{hi:.3f}), {r['replies']} replies, "
                  f"position-1 acceptance {r['acceptance_per_pos'][0]:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def cmd_dashboards(args):
    from deployments import dashboards

    try:
        dashboards.run(args)
    except dashboards.PushError as e:
        print(f"dflash-serve dashboards: error: {e}", file=sys.stderr)
        sys.exit(1)


def cmd_plot_panel(args):
    from deployments import dashboards

    dashboards.plot(args)


def cmd_loadtest(args):
    from loadtest import run

    run_checked("loadtest", run, run.LoadTestConfig, args)


def cmd_lockstep(args):
    from loadtest import lockstep

    run_checked("lockstep", lockstep, lockstep.LockstepConfig, args)


def cmd_soak(args):
    from loadtest import soak

    run_checked("soak", soak, soak.SoakConfig, args)


COMMANDS = {
    "generate": cmd_generate, "bench": cmd_bench, "bench-serve": cmd_bench_serve, "serve": cmd_serve,
    "datagen": cmd_datagen, "train": cmd_train, "train-curves": cmd_train_curves, "eval-drafter": cmd_eval_drafter,
    "dashboards": cmd_dashboards, "plot-panel": cmd_plot_panel, "loadtest": cmd_loadtest, "lockstep": cmd_lockstep,
    "soak": cmd_soak,
}


def main(argv=None):
    cap_matmul_caches()
    parser, subparsers = build_parser()
    args = parser.parse_args(argv)
    check(args, subparsers[args.command])
    try:
        COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as e:  # bad input found while loading (model, drafter, prompt)
        print(f"dflash-serve {args.command}: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
