"""`dflash-serve loadtest`: Locust scenarios against the server, speculation on and off, fixed and
adaptive blocks, at several user counts; a Markdown report with plots.

It builds the traffic (loadtest/scenarios.py), then either attaches to a running server (--url:
one variant, that server as it is) or starts a loopback Ray cluster and deploys the variants' apps
from the same code path as `dflash-serve serve`:
  ar        the server without a drafter (plain autoregressive decoding)
  b<N>      the server with the drafter, fixed policy, every request verifying blocks of N
            (one app; the block is the request's `block_size` extension field)
  adaptive  the server with the drafter and the adaptive block policy (DFlash drafts only)
  dflash+suffix  the same with suffix drafting beside DFlash (the server's default)
For each scenario, each user count and each variant (the innermost loop, so the runs compared sit
close in time) it runs Locust headless as its own process (never in a Ray process), bounded by
--run-time and --max-requests, and reads the run's summary that the Locust process writes when it
quits: tokens, failures, usage.spec_decoding, and Locust's own latency percentiles (its CSV is kept
too, but its last rows can miss requests that finished while Locust stopped).
Throughput = output tokens / (first request sent .. last request done).

The cluster declares one logical CPU per app although the machine may have fewer: only one app is
under load at a time, each replica runs 1 torch thread, and the load generator uses the rest.
"""

import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from deployments.config import AppConfig
from engine.stats import geomean_interval

ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
STEP_SHAPE = ROOT / "loadtest" / "step_shape.py"
USERS = {"chat": "ChatUser", "rag": "RagUser", "agent": "AgentUser"}
SHAPES = ("steady", "poisson", "step")
HYBRID = "dflash+suffix"  # the variant with suffix drafting beside DFlash (adaptive policy)


@dataclass
class LoadTestConfig:
    scenarios: list[str] = field(default_factory=lambda: list(USERS))
    users: list[int] = field(default_factory=lambda: [1, 4, 16])
    variants: list[str] = field(default_factory=lambda: ["ar", "b2", "b3", "b4", "adaptive", HYBRID])
    run_time: float = 30.0  # seconds of load per run (scenario x users x variant x repeat)
    repeats: int = 1  # runs per cell, interleaved with the other variants; the report keeps the median
    max_requests: int = 500  # per cell
    requests_per_user: int = 0  # > 0: a cell also stops after this many requests per user (same requests for every variant)
    min_requests: int = 0  # with requests_per_user: but never before this many (4 requests at 1 user are seconds of noise)
    max_tokens: int = 64
    temperature: float = 0.0
    shape: str = "steady"
    think_time: float = 2.0  # poisson: mean seconds between a user's requests
    url: str | None = None
    target: str | None = None
    draft: str = "default"
    dtype: str = "auto"
    max_slots: int | None = None  # per replica; None: the largest user count
    num_cpus: float = 1.0  # Ray CPUs per replica (torch threads: this rounded, at least 1)
    out: str = "loadtest-report"
    seed: int = 0
    resume: bool = False  # reuse the runs whose summaries --out already holds (an interrupted sweep goes on)


def variant_block(name: str) -> int | None:
    """The fixed block of a b<N> variant, else None."""
    return int(name[1:]) if name.startswith("b") and name[1:].isdigit() else None


def check_config(cfg: LoadTestConfig) -> str | None:
    """What is wrong with cfg, as a message naming the flag; None when it is fine."""
    unknown = [s for s in cfg.scenarios if s not in USERS]
    if unknown or not cfg.scenarios:
        return f"--scenarios: unknown or none: {', '.join(unknown) or '(empty)'}; choose from {', '.join(USERS)}"
    if not cfg.users or any(u < 1 for u in cfg.users):
        return f"--users must be a list of integers >= 1, got {cfg.users}"
    bad = [v for v in cfg.variants if v not in ("ar", "adaptive", HYBRID) and not (variant_block(v) or 0) >= 1]
    if bad or not cfg.variants:
        return (f"--variants: unknown or none: {', '.join(bad) or '(empty)'}; use ar, adaptive, {HYBRID} or b<N> "
                "(N >= 1)")
    if cfg.run_time <= 0:
        return f"--run-time must be > 0 seconds, got {cfg.run_time}"
    if cfg.repeats < 1:
        return f"--repeats must be >= 1, got {cfg.repeats}"
    if cfg.max_requests < 1:
        return f"--max-requests must be >= 1, got {cfg.max_requests}"
    if cfg.requests_per_user < 0:
        return f"--requests-per-user must be >= 0, got {cfg.requests_per_user}"
    if cfg.min_requests < 0:
        return f"--min-requests must be >= 0, got {cfg.min_requests}"
    if cfg.max_tokens < 1:
        return f"--max-tokens must be >= 1, got {cfg.max_tokens}"
    if cfg.temperature < 0:
        return f"--temperature must be >= 0, got {cfg.temperature}"
    if cfg.shape not in SHAPES:
        return f"--shape must be one of {', '.join(SHAPES)}, got {cfg.shape}"
    if cfg.shape == "poisson" and cfg.think_time <= 0:
        return f"--think-time must be > 0 with --shape poisson, got {cfg.think_time}"
    if cfg.url is not None and not cfg.url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
        return f"--url must be a loopback address (http://127.0.0.1:PORT), got {cfg.url}"
    if not Path(cfg.out).resolve().parent.is_dir():
        return f"--out {cfg.out}: the folder {Path(cfg.out).resolve().parent} does not exist"
    before = Path(cfg.out) / "config.json"
    if cfg.resume and before.exists():
        changed = [k for k, v in json.loads(before.read_text()).items() if settings(cfg).get(k) != v]
        if changed:
            return (f"--resume: the runs in {cfg.out} were made with other " + ", ".join(
                f"--{k.replace('_', '-')}" for k in changed) + "; use the same flags or another --out")
    try:
        for config in apps(cfg).values():
            AppConfig(**config)
    except ValueError as e:
        return " ".join(str(e).split())
    return None


def settings(cfg: LoadTestConfig) -> dict:
    """The flags that shape the runs (what --resume must find unchanged)."""
    return {k: v for k, v in asdict(cfg).items() if k not in ("resume", "out")}


def apps(cfg: LoadTestConfig) -> dict[str, dict]:
    """The server apps the variants need: {app name: AppConfig fields} (none with --url)."""
    if cfg.url:
        return {}
    base = {"target": cfg.target, "draft": cfg.draft, "dtype": cfg.dtype, "num_cpus": cfg.num_cpus,
            "max_slots": cfg.max_slots or max(cfg.users), "proposers": "dflash"}
    out = {}
    largest = max([16] + [variant_block(x) or 0 for x in cfg.variants])
    for v in cfg.variants:
        if v == "ar":
            out["ar"] = dict(base, draft="none")
        elif v == "adaptive":
            out["adaptive"] = dict(base, policy="adaptive", block_size=largest)
        elif v == HYBRID:
            out[app_of(v)] = dict(base, policy="adaptive", block_size=largest, proposers="dflash,suffix",
                                  api_keys=[run_key(s, u, r) for s in cfg.scenarios for u in cfg.users
                                            for r in range(cfg.repeats)])
        else:
            out["fixed"] = dict(base, policy="fixed", block_size=max(variant_block(x) or 0 for x in cfg.variants))
    return out


def request_limit(cfg: LoadTestConfig, users: int) -> int:
    """Requests a cell at this user count stops after."""
    if not cfg.requests_per_user:
        return cfg.max_requests
    return min(cfg.max_requests, max(cfg.min_requests, cfg.requests_per_user * users))


def run_order(variants: list[str], repeat: int) -> list[str]:
    """The variants' order in one repeat of a cell: as given, reversed in odd repeats, so no variant always
    runs right after the same one (b4 after b2 on the same app) or always first after a change of cell."""
    return list(variants) if repeat % 2 == 0 else list(reversed(variants))


def run_key(scenario: str, users: int, repeat: int | None) -> str:
    """The API key a run's users send. The dflash+suffix app holds one per run, and keys split its shared
    suffix index: a run never drafts from the server's replies to an earlier run's identical requests."""
    return f"loadtest-{scenario}-u{users}-r{repeat or 0}"


def app_of(variant: str) -> str:
    return "fixed" if variant_block(variant) else {HYBRID: "suffix"}.get(variant, variant)


# ---- one Locust run -------------------------------------------------------------------------------


def locust_command(cfg: LoadTestConfig, scenarios: list[str], users: int, url: str, prefix: Path, block: int | None,
                   scenario_file: Path, api_key: str = "loadtest") -> list[str]:
    """Locust, headless, as its own process: these scenarios' user classes (equal weights)."""
    files = f"{LOCUSTFILE},{STEP_SHAPE}" if cfg.shape == "step" else str(LOCUSTFILE)
    command = [sys.executable, "-m", "locust", "-f", files, "--headless", "--only-summary", "-u", str(users),
               "-r", str(users), "-t", f"{cfg.run_time:g}s", "--stop-timeout", "120", "--host", url,
               "--csv", str(prefix), "--scenario-file", str(scenario_file), "--summary-json", f"{prefix}.json",
               "--max-tokens", str(cfg.max_tokens), "--temperature", str(cfg.temperature),
               "--max-requests", str(request_limit(cfg, users)), "--seed", str(cfg.seed), "--api-key", api_key]
    if cfg.shape == "poisson":
        command += ["--think-time", str(cfg.think_time)]
    if cfg.shape == "step":
        command += ["--step-users", str(max(1, users // 4)), "--step-time", f"{cfg.run_time / 4:g}"]
    if block is not None:
        command += ["--block-size", str(block)]
    return command + [USERS[s] for s in scenarios]


def run_cell(cfg: LoadTestConfig, scenario: str, users: int, variant: str, url: str, folder: Path,
             scenario_file: Path, repeat: int | None = None) -> dict:
    """One Locust run; its figures (latency percentiles in ms, throughput, acceptance). With cfg.resume
    a run whose summary is already in `folder` is read back instead (Locust writes it as it quits)."""
    prefix = folder / (f"{scenario}-u{users}-{variant}" + ("" if repeat is None else f"-r{repeat}"))
    summary_path = Path(f"{prefix}.json")
    if not (cfg.resume and summary_path.exists()):
        summary_path.unlink(missing_ok=True)
        command = locust_command(cfg, [scenario], users, url, prefix, variant_block(variant), scenario_file,
                                 run_key(scenario, users, repeat))
        log = Path(f"{prefix}.log")
        with open(log, "w") as f:
            done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=cfg.run_time + 300,
                                  env=dict(os.environ, PYTHONPATH=str(ROOT)))
        if done.returncode not in (0, 1) or not summary_path.exists():  # 1: Locust saw failures
            raise RuntimeError(f"locust exited with {done.returncode}; see {log}:\n{log.read_text()[-2000:]}")
    summary = json.loads(summary_path.read_text())
    totals = summary.get(scenario, {"requests": 0, "failures": 0, "output_tokens": 0, "num_drafts": 0,
                                    "num_accepted_tokens": 0, "block_sizes": {}})
    wall = summary["_wall"]
    seconds = (wall["end"] or wall["start"]) - wall["start"]
    return {
        "requests": totals["requests"], "failures": totals["failures"], "output_tokens": totals["output_tokens"],
        "seconds": seconds, "output_tokens_per_s": totals["output_tokens"] / seconds if seconds > 0 else None,
        "mean_acceptance_length": 1 + totals["num_accepted_tokens"] / totals["num_drafts"]
        if totals["num_drafts"] else None,
        "block_sizes": totals["block_sizes"], "valid_json": totals.get("valid_json"),
        "json_expected": totals.get("json_expected"), "latency_ms": totals.get("locust_stats", {}),
    }


def median_run(repeats: list[dict]) -> dict:
    """Of a cell's repeated runs, the one with the median output tokens/s (its latencies with it),
    plus every run's tokens/s and the cell's totals of requests and failures."""
    ranked = sorted(repeats, key=lambda c: c["output_tokens_per_s"] or 0)
    cell = dict(ranked[(len(ranked) - 1) // 2])
    cell.update(tokens_per_s_runs=[c["output_tokens_per_s"] for c in repeats],
                requests=sum(c["requests"] for c in repeats), failures=sum(c["failures"] for c in repeats))
    return cell


# ---- the report -------------------------------------------------------------------------------------


def p50(cell: dict, kind: str):
    return cell["latency_ms"].get(kind, {}).get("p50")


def ratio(a, b):
    return a / b if a and b else None


def paired_ratios(cells: dict, fixed: list[str]) -> list[float] | None:
    """Per repeat, adaptive's tok/s over the best fixed block's in that repeat (the runs compared sit
    together in time, so a machine that speeds up or slows down between repeats moves both)."""
    runs = [cells[v].get("tokens_per_s_runs") for v in ["adaptive", *fixed]]
    if not all(runs) or len({len(r) for r in runs}) != 1:
        return None
    best = [max(r[i] for r in runs[1:]) for i in range(len(runs[0]))]
    return [ratio(a, b) for a, b in zip(runs[0], best)]


def comparisons(results: dict) -> dict:
    """Per scenario and user count: each variant against ar (tok/s and TPOT speed-up, TTFT cost),
    the best fixed block, and whether adaptive reached it."""
    out = {}
    for scenario, by_users in results.items():
        for users, cells in by_users.items():
            ar = cells.get("ar")
            row = {}
            for v, cell in cells.items():
                if v == "ar" or ar is None:
                    continue
                row[v] = {"tokens_per_s_x": ratio(cell["output_tokens_per_s"], ar["output_tokens_per_s"]),
                          "tpot_x": ratio(p50(ar, "TPOT"), p50(cell, "TPOT")),
                          "ttft_cost_x": ratio(p50(cell, "TTFT"), p50(ar, "TTFT"))}
            fixed = {v: c["output_tokens_per_s"] or 0 for v, c in cells.items() if variant_block(v)}
            if fixed:
                best = max(fixed, key=fixed.get)
                row["best_fixed"] = best
                if HYBRID in cells:
                    row["dflash+suffix_vs_best_fixed"] = ratio(cells[HYBRID]["output_tokens_per_s"], fixed[best])
                if "adaptive" in cells:
                    row["adaptive_vs_best_fixed"] = ratio(cells["adaptive"]["output_tokens_per_s"], fixed[best])
                    paired = paired_ratios(cells, list(fixed))
                    if paired:
                        row["adaptive_vs_best_fixed_by_repeat"] = paired
            if HYBRID in cells and "adaptive" in cells:
                row["dflash+suffix_vs_adaptive"] = ratio(cells[HYBRID]["output_tokens_per_s"],
                                                         cells["adaptive"]["output_tokens_per_s"])
            out.setdefault(scenario, {})[users] = row
    return out


def pooled(results: dict) -> dict | None:
    """Adaptive's tok/s over every paired repeat of every scenario and load, against
    - same_repeat: the best fixed block of the same repeat. This favours the fixed blocks: the best of
      several noisy runs picks up their noise (a variant equal to the fixed ones would lose);
    - chosen_ahead (when every cell has 2 runs or more): the fixed block that was best in the cell's other
      repeats, measured in this one: a block chosen before the run, as an operator would choose one;
    - one_block: the fixed block that is best over all scenarios and loads together, a server's one setting;
    - ar: the server without speculation."""
    same, ahead, ar, by_block = [], [], [], {}
    for by_users in results.values():
        for cells in by_users.values():
            fixed = [v for v in cells if variant_block(v)]
            paired = paired_ratios(cells, fixed) if "adaptive" in cells and fixed else None
            if not paired:
                continue
            same += paired
            runs = {v: cells[v]["tokens_per_s_runs"] for v in ["adaptive", *fixed]}
            ar_runs = cells.get("ar", {}).get("tokens_per_s_runs")
            n = len(paired)
            for i, a in enumerate(runs["adaptive"]):
                if n > 1:  # a block chosen ahead needs the cell's other repeats
                    choice = max(fixed, key=lambda v: sum(runs[v][j] for j in range(n) if j != i))
                    ahead.append(ratio(a, runs[choice][i]))
                for v in fixed:
                    by_block.setdefault(v, []).append(ratio(a, runs[v][i]))
                if ar_runs and len(ar_runs) == n:
                    ar.append(ratio(a, ar_runs[i]))
    if len(same) < 2 or not all(same + ahead + ar):
        return None
    one = {v: geomean_interval(r) for v, r in by_block.items() if len(r) == len(same)}
    out = {"same_repeat": geomean_interval(same)}
    if len(ahead) == len(same):
        out["chosen_ahead"] = geomean_interval(ahead)
    if one:
        best = min(one, key=lambda v: one[v]["geomean"])
        out["one_block"] = {**one[best], "block": best}
    if ar:
        out["ar"] = geomean_interval(ar)
    return out


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    c = report["config"]
    per_user = ""
    if c.get("requests_per_user"):
        per_user = f", {c['requests_per_user']} per user" + (f", at least {c['min_requests']}" if c.get("min_requests") else "")
    lines = [f"# Load test: {', '.join(c['scenarios'])} at {', '.join(map(str, c['users']))} users", "",
             f"Server: {report['server']}. Load: {c['shape']} users, {c.get('repeats', 1)} run(s) per cell "
             f"(the median by tok/s shown; requests and failures summed), {c['run_time']:g} s per run (at most "
             f"{c['max_requests']} requests{per_user}), max_tokens {c['max_tokens']}, temperature {c['temperature']:g}. "
             f"Locust {report['locust_version']}; machine: {report['machine']}.", "",
             "tok/s: output tokens / wall time of the run; TTFT, TPOT, ITL: p50 / p90 in ms (Locust's "
             "percentiles); MAL: mean acceptance length (usage.spec_decoding); x AR: speed-up over the "
             "server without speculation in the same scenario and load.", ""]
    for scenario, by_users in report["results"].items():
        lines += [f"## {scenario}", "", "| users | variant | requests | fail | tok/s | x AR tok/s | TPOT | x AR TPOT "
                  "| TTFT | TTFT cost | ITL | MAL |", "|" + "---|" * 12]
        for users, cells in by_users.items():
            cmp = report["comparisons"].get(scenario, {}).get(users, {})
            for v, cell in cells.items():
                lat = cell["latency_ms"]
                pair = {k: f"{fmt(lat.get(k, {}).get('p50'), '.0f')} / {fmt(lat.get(k, {}).get('p90'), '.0f')}"
                        for k in ("TTFT", "TPOT", "ITL")}
                vs = cmp.get(v, {})
                lines.append(f"| {users} | {v} | {cell['requests']} | {cell['failures']} | "
                             f"{fmt(cell['output_tokens_per_s'], '.1f')} | {fmt(vs.get('tokens_per_s_x'))} | "
                             f"{pair['TPOT']} | {fmt(vs.get('tpot_x'))} | {pair['TTFT']} | "
                             f"{fmt(vs.get('ttft_cost_x'))} | {pair['ITL']} | {fmt(cell['mean_acceptance_length'])} |")
        lines.append("")
        adaptive = [(u, r) for u, r in report["comparisons"].get(scenario, {}).items() if "adaptive_vs_best_fixed" in r]
        if adaptive:
            lines += ["Adaptive vs the best fixed block (tok/s): " + "; ".join(
                f"{u} users: {fmt(r['adaptive_vs_best_fixed'])}x ({r['best_fixed']})" for u, r in adaptive), ""]
            paired = [(u, r["adaptive_vs_best_fixed_by_repeat"]) for u, r in adaptive if r.get("adaptive_vs_best_fixed_by_repeat")]
            if paired:
                lines += ["The same, repeat by repeat (adaptive over the best fixed block of its own repeat; median, then "
                          "each repeat): " + "; ".join(
                              f"{u} users: {fmt(statistics.median(x for x in rs if x))}x ({', '.join(fmt(x) for x in rs)})"
                              for u, rs in paired), ""]
        hybrid = [(u, r) for u, r in report["comparisons"].get(scenario, {}).items() if "dflash+suffix_vs_adaptive" in r]
        if hybrid:
            lines += ["dflash+suffix vs DFlash-only adaptive (tok/s): " + "; ".join(
                f"{u} users: {fmt(r['dflash+suffix_vs_adaptive'])}x" for u, r in hybrid), ""]
        agent = [(u, cells) for u, cells in by_users.items() if any(c.get("json_expected") for c in cells.values())]
        if agent:
            lines += ["Valid JSON replies (tool calls and answers): " + "; ".join(
                f"{u} users {v} {c['valid_json']}/{c['json_expected']}" for u, cells in agent
                for v, c in cells.items()), ""]
    pool = report.get("pooled")
    if pool:
        names = {"same_repeat": "the best fixed block of the same repeat",
                 "chosen_ahead": "the fixed block best in the cell's other repeats (chosen ahead)",
                 "one_block": "the one fixed block best over all scenarios and loads", "ar": "AR"}
        lines += ["## All scenarios and loads", "", f"Adaptive's tok/s over every paired repeat ({pool['same_repeat']['n']} "
                  "runs; geometric mean, 95% bootstrap interval):", ""]
        lines += [f"- over {names[k]}{' (' + g['block'] + ')' if 'block' in g else ''}: {fmt(g['geomean'], '.3f')}x "
                  f"({fmt(g['low'], '.3f')}-{fmt(g['high'], '.3f')})" for k, g in pool.items()]
        lines += ["", "The best fixed block of a repeat is the best of several noisy runs, which favours it; a block "
                  "chosen ahead is what a server would run without adapting.", ""]
    failures = sum(cell["failures"] for by_users in report["results"].values() for cells in by_users.values()
                   for cell in cells.values())
    lines += [f"Failures in all runs: {failures}.", ""]
    return "\n".join(lines)


def plot(report: dict, path: Path):
    """Per scenario (columns): tok/s, TPOT p50/p90 and TTFT p50 against users, one line per variant;
    and a bar chart of mean acceptance length per scenario and variant."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    results = report["results"]
    fig = Figure(figsize=(4.2 * len(results), 10))
    FigureCanvasAgg(fig)
    rows = [("output tokens/s", lambda c: c["output_tokens_per_s"], None),
            ("TPOT p50 (solid) / p90 (dashed), ms", lambda c: p50(c, "TPOT"),
             lambda c: c["latency_ms"].get("TPOT", {}).get("p90")),
            ("TTFT p50 (ms)", lambda c: p50(c, "TTFT"), None)]
    for j, (scenario, by_users) in enumerate(results.items()):
        users = list(by_users)
        variants = list(next(iter(by_users.values())))
        for i, (label, get, get_p90) in enumerate(rows):
            ax = fig.add_subplot(len(rows) + 1, len(results), i * len(results) + j + 1)
            for k, v in enumerate(variants):
                color = f"C{k}"
                ax.plot(users, [get(by_users[u][v]) for u in users], marker="o", color=color, label=v)
                if get_p90:
                    ax.plot(users, [get_p90(by_users[u][v]) for u in users], ls="--", color=color)
            ax.set_xscale("log", base=2)
            ax.set_xticks(users, [str(u) for u in users])
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(scenario)
                ax.legend(fontsize=7)
            if j == 0:
                ax.set_ylabel(label, fontsize=8)
            if i == len(rows) - 1:
                ax.set_xlabel("users")
        ax = fig.add_subplot(len(rows) + 1, len(results), len(rows) * len(results) + j + 1)
        width = 0.8 / max(1, len(users))
        for k, u in enumerate(users):
            mal = [by_users[u][v]["mean_acceptance_length"] or 0 for v in variants]
            ax.bar([x + k * width for x in range(len(variants))], mal, width, label=f"{u} users")
        ax.set_xticks([x + width * (len(users) - 1) / 2 for x in range(len(variants))], variants, fontsize=7)
        ax.set_ylabel("mean acceptance length" if j == 0 else "", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    c = report["config"]
    fig.suptitle(f"dflash-serve load test: {c['shape']} users, {c['run_time']:g} s per run, max_tokens "
                 f"{c['max_tokens']}, T={c['temperature']:g}; {report['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- the whole run ----------------------------------------------------------------------------------


def run(cfg: LoadTestConfig, cluster_url: str | None = None) -> dict:
    """Build the traffic, run every cell, write report.json, report.md and loadtest.png into cfg.out.

    Servers: cfg.url attaches to a running server; else with `cluster_url` (the caller's Serve proxy,
    Ray already initialised) the variants' apps are deployed into that cluster and deleted at the end;
    else this starts a loopback Ray cluster with a logical CPU per app and shuts it down at the end."""
    problem = check_config(cfg)
    if problem:
        raise ValueError(problem)
    from importlib.metadata import version

    from deployments import bench_serve
    from loadtest import scenarios

    out = Path(cfg.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(settings(cfg), indent=1) + "\n")
    scenario_file = out / "scenarios.json"
    print(f"loadtest: building the traffic into {scenario_file}", file=sys.stderr)
    scenarios.build(scenario_file, seed=cfg.seed)
    variants = ["server"] if cfg.url else cfg.variants
    needed = {f"loadtest-{name}": AppConfig(**c) for name, c in apps(cfg).items()}
    owned_cluster = False
    try:
        if cfg.url:
            urls = {"server": cfg.url.rstrip("/")}
            server = f"the server at {cfg.url}"
        else:
            if cluster_url is None:
                cluster_url, owned_cluster = bench_serve.start_cluster(math.ceil(len(needed) * cfg.num_cpus)), True
            print(f"loadtest: deploying {', '.join(needed)}", file=sys.stderr)
            by_app = bench_serve.deploy_apps({name: (f"/{name}", c) for name, c in needed.items()}, cluster_url)
            urls = {v: by_app[f"loadtest-{app_of(v)}"] for v in variants}
            server = (f"loopback Ray cluster, apps {', '.join(needed)} (colocated, "
                      f"{cfg.num_cpus:g} CPU and {max(1, round(cfg.num_cpus))} torch thread per replica)")
        key = run_key(cfg.scenarios[0], cfg.users[0], 0)
        info = {v: bench_serve.server_info(urls[v], key) for v in dict.fromkeys(variants)}
        info = next((i for v, i in info.items() if v != "ar"), info[variants[0]])  # the drafter's app when any
        results: dict[str, dict[int, dict]] = {}
        cells = [(s, u, r, v) for s in cfg.scenarios for u in cfg.users for r in range(cfg.repeats)
                 for v in run_order(variants, r)]
        runs: dict[tuple, list[dict]] = {}
        for s, u, r, v in tqdm(cells, desc="loadtest", unit="run"):
            repeat = r if cfg.repeats > 1 else None
            runs.setdefault((s, u, v), []).append(run_cell(cfg, s, u, v, urls[v], out / "runs", scenario_file, repeat))
        for (s, u, v), repeats in runs.items():
            results.setdefault(s, {}).setdefault(u, {})[v] = median_run(repeats)
    finally:
        if not cfg.url and cluster_url is not None:
            from ray import serve

            if owned_cluster:
                import ray

                serve.shutdown()
                ray.shutdown()
            else:
                for name in needed:
                    serve.delete(name)
    machine = bench_serve.machine()
    report = {"config": asdict(cfg), "server": f"{server}; {info}", "locust_version": version("locust"),
              "machine": f"{machine['cpu_count']} CPUs, torch {machine['torch']}, Python {machine['python']}",
              "results": results, "comparisons": comparisons(results),
              "pooled": pooled(results)}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report) + "\n![load test](loadtest.png)\n")
    plot(report, out / "loadtest.png")
    print(markdown(report))
    print(f"loadtest: report in {out / 'report.md'} (plot {out / 'loadtest.png'})", file=sys.stderr)
    return report
