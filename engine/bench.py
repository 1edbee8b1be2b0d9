"""Side-by-side decoding benchmark: transformers, z-lab's reference DFlash and this engine run on the
same prompts, weights and settings in one process; it prints a table and writes JSON and a plot.

It owns the method adapters, the timing and the comparison metrics; our engines come from
engine.config (build_engine), one per method, all on the same loaded models.
"""

import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from engine.config import EngineConfig, build_engine, load_models
from engine.engine import Engine, SamplingParams
from engine.loading import quantize_int8, stop_token_ids
from engine.prompts import DEFAULT_PROMPTS, Prompt, chat, read_prompts
from engine.stats import SpecStats, geomean_interval
from engine.suffix import SuffixProposer

METHODS = ("hf", "hf-lookup", "zlab", "ar", "dflash", "dflash-chain", "dflash-adaptive", "suffix", "dflash+suffix")
NEEDS_DRAFTER = {"zlab", "dflash", "dflash-chain", "dflash-adaptive", "dflash+suffix", "suffix"}  # speculate: not with --draft none
NEEDS_HF_MODEL = {"hf", "hf-lookup", "zlab"}
BATCHABLE = ("ar", "dflash", "dflash-chain", "dflash-adaptive", "suffix", "dflash+suffix")
WARMUP_PROMPT = chat("Hi!")
WARMUP_TOKENS = 8


@dataclass
class BenchConfig:
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    block_sizes: list[int] = field(default_factory=list)  # extra fixed-block runs, named dflash-b{N}
    prompts: str | None = None  # a JSONL file; None: the built-in prompts
    num_prompts: int | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    unseeded: bool = False  # sampled requests carry no seed, as a server's usually do (rejection sampling)
    # our engines' settings; each method sets its own policy, and the bench its slots and context length
    engine: EngineConfig = field(default_factory=EngineConfig)
    batch_size: int | None = None
    repeats: int = 1
    json: str | None = None
    plot: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def load_prompts(cfg: BenchConfig) -> list[Prompt]:
    prompts = read_prompts(cfg.prompts) if cfg.prompts else DEFAULT_PROMPTS
    if cfg.num_prompts is not None and cfg.num_prompts > len(prompts):
        raise ValueError(f"--num-prompts {cfg.num_prompts}: there are only {len(prompts)} prompts")
    return prompts[: cfg.num_prompts]


# ---- methods: each maps (prompt ids, sampling params) to a Generation ----------------------------


@dataclass
class Generation:
    output_ids: list[int]
    ttft: float  # seconds from the call to its first token (prefill)
    acceptance_lengths: list[int] | None = None  # tokens committed per speculative step
    stats: SpecStats | None = None


class FirstTokenTimer:
    """A transformers streamer that notes when generate() produces its first token (its first put()
    is the prompt)."""

    def __init__(self):
        self.start, self.puts, self.ttft = time.perf_counter(), 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.ttft = time.perf_counter() - self.start

    def end(self):
        pass


Method = Callable[[list[int], SamplingParams], Generation]


def hf_method(model, stops, lookup: bool) -> Method:
    """transformers generate(), optionally with prompt-lookup decoding."""
    extra = {"prompt_lookup_num_tokens": 10} if lookup else {}

    def generate(ids, p):
        if p.seed is not None:
            torch.manual_seed(p.seed)
        sampling = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k} if p.temperature > 0 else {}
        input_ids, timer = torch.tensor([ids], device=model.device), FirstTokenTimer()
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=p.max_tokens, streamer=timer,
            do_sample=p.temperature > 0, eos_token_id=list(stops) or None, pad_token_id=(stops or [None])[0], **sampling, **extra,
        )
        return Generation(out[0, len(ids):].tolist(), timer.ttft)

    return generate


def zlab_method(draft_model, model, stops, block_size) -> Method:
    """z-lab's reference dflash_generate (its max_new_tokens counts the first token, like ours)."""
    import dflash.model

    if model.device.type == "cpu":  # return_stats times with torch.cuda.synchronize(); a CPU run has no CUDA
        dflash.model._cuda_time = time.perf_counter

    def generate(ids, p):
        if p.seed is not None:
            torch.manual_seed(p.seed)
        out = dflash.model.dflash_generate(
            draft_model, model, torch.tensor([ids], device=model.device), p.max_tokens, list(stops),
            p.temperature, p.top_p, p.top_k, block_size, return_stats=True,
        )
        return Generation(out.output_ids[0, len(ids):].tolist(), out.time_to_first_token, list(out.acceptance_lengths))

    return generate


def fresh_state(engine: Engine):
    """An empty suffix index and no finished request's cache to start from before each timed run: a
    prompt's own earlier run (a warm-up, an earlier repeat) would otherwise be proposed back to it, or
    spare it its prefill, which no real request gets."""
    if engine.suffix is not None:
        engine.suffix = SuffixProposer(engine.suffix.config)
    engine.forget_finished()


def engine_method(engine: Engine, block_size: int | None) -> Method:
    def generate(ids, p):
        fresh_state(engine)
        start, ttft = time.perf_counter(), None
        r = engine.add_request(ids, replace(p, block_size=block_size))
        try:
            while not r.finished:
                engine.step()
                if ttft is None and r.output_ids:
                    ttft = time.perf_counter() - start
        finally:
            engine.abort(r.request_id)
        spec = engine.drafter is not None or engine.suffix is not None
        return Generation(r.output_ids, ttft, r.acceptance_lengths if spec else None, r.stats if spec else None)

    return generate


def zlab_drafter_dir(loaded, drafter, tmp: Path) -> Path:
    """The drafter folder z-lab loads: ours, or the random drafter saved there in the run dtype."""
    if loaded.drafter_name != "random":
        return Path(loaded.drafter_name)
    from engine.drafter import save_drafter

    save_drafter(drafter, tmp, loaded.dtype)
    return tmp


@dataclass
class Setup:
    methods: dict[str, Method]
    engines: dict[str, EngineConfig]  # our methods, to rebuild batched
    loaded: object  # the models every method runs (ours with the int8 drafter when asked)
    tokenizer: object
    prompt_ids: list[list[int]]
    block_size: int
    notes: list[str]


def setup(cfg: BenchConfig, prompts: list[Prompt], tmp: Path) -> Setup:
    """Load every model once, tokenise the prompts, build cfg.methods then the block-size sweep."""
    loaded = load_models(replace(cfg.engine, int8_drafter=False))
    prompt_ids = [p.token_ids(loaded.tokenizer) for p in prompts]
    drafter, notes, ours = loaded.drafter, [], loaded
    block_size = cfg.engine.max_block_size(drafter)
    if cfg.engine.int8_drafter:
        ours = replace(loaded, drafter=quantize_int8(drafter, copy=True))
        notes.append("--int8-drafter: our methods use the int8 drafter; zlab uses the unquantised weights")
    if cfg.engine.denoising_steps > 1:
        notes.append(f"--denoising-steps {cfg.engine.denoising_steps}: zlab always runs one denoising pass")
    if getattr(drafter, "draft_vocab", None) is not None and not cfg.engine.full_draft_head:
        notes.append(f"our methods draft from the drafter's {len(drafter.draft_vocab)}-token draft vocabulary; "
                     "zlab scores the full vocabulary (--full-draft-head: like for like)")
    stops = stop_token_ids(loaded.target_path)
    hf_model = load_hf_model(loaded, cfg.engine.device) if NEEDS_HF_MODEL & set(cfg.methods) else None
    longest = max(len(ids) for ids in prompt_ids + [WARMUP_PROMPT.token_ids(loaded.tokenizer)])
    engines = engine_configs(cfg, block_size, max_len=longest + cfg.max_new_tokens + 1)
    methods = {}
    for name in cfg.methods + [f"dflash-b{b}" for b in cfg.block_sizes]:
        if name in engines:
            methods[name] = engine_method(build_engine(engines[name], ours), engines[name].block_size)
        elif name in ("hf", "hf-lookup"):
            methods[name] = hf_method(hf_model, stops, lookup=name == "hf-lookup")
        elif name == "zlab":
            from dflash.model import DFlashDraftModel

            folder = zlab_drafter_dir(loaded, drafter, tmp)
            zdraft = DFlashDraftModel.from_pretrained(str(folder), dtype=loaded.dtype).to(cfg.engine.device).eval()
            methods[name] = zlab_method(zdraft, hf_model, stops, block_size)
    return Setup(methods, engines, ours, loaded.tokenizer, prompt_ids, block_size, notes)


def load_hf_model(loaded, device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(loaded.target_path, dtype=loaded.dtype, local_files_only=True)
    return model.to(device).eval()


def engine_configs(cfg: BenchConfig, block_size: int, max_len: int) -> dict[str, EngineConfig]:
    """Our methods among cfg.methods, plus dflash-b{N} per --block-sizes: one request at a time; the
    requests of a run verify at most the engine's block_size (none for ar: no drafter)."""
    one = replace(cfg.engine, max_slots=1, max_len=max_len, proposers="dflash")
    configs = {"ar": replace(one, draft="none", int8_drafter=False, policy="fixed", block_size=None),
               "dflash": replace(one, policy="fixed", block_size=block_size),
               "dflash-adaptive": replace(one, policy="adaptive", block_size=block_size),
               "dflash-chain": replace(one, policy="adaptive", block_size=block_size, draft_tree=False),
               "suffix": replace(one, int8_drafter=False, policy="fixed", block_size=None, proposers="suffix"),
               "dflash+suffix": replace(one, policy="adaptive", block_size=block_size, proposers="dflash,suffix")}
    out = {name: configs[name] for name in cfg.methods if name in configs}
    for b in cfg.block_sizes:
        out[f"dflash-b{b}"] = replace(one, policy="fixed", block_size=b)
    return out


# ---- timing ---------------------------------------------------------------------------------


def sampling_params(cfg: BenchConfig, index: int, max_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens or cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
        top_k=cfg.top_k, seed=None if cfg.unseeded else cfg.seed + index,
    )


def timed(fn):
    """(result, seconds) of one call."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def time_methods(methods: dict[str, Method], prompt_ids, cfg: BenchConfig, tokenizer) -> dict[str, list[dict]]:
    """Per-prompt records per method. Prompts outer, methods inner, so paired runs sit close in time;
    with --repeats the whole sweep runs again and each run keeps its fastest time (on a shared
    machine noise only ever adds time, and bursts of load hit one sweep, not every repeat)."""
    warmup_ids = WARMUP_PROMPT.token_ids(tokenizer)
    for fn in methods.values():  # first calls allocate, pick kernels and fill caches
        fn(warmup_ids, sampling_params(cfg, 0, WARMUP_TOKENS))
    best: dict[tuple[str, int], tuple[Generation, float]] = {}
    with tqdm(total=cfg.repeats * len(methods) * len(prompt_ids), desc="bench", unit="run") as bar:
        for _ in range(cfg.repeats):
            for i, ids in enumerate(prompt_ids):
                params = sampling_params(cfg, i)
                for name, fn in methods.items():
                    bar.set_postfix_str(f"{name} #{i}")
                    result, seconds = timed(lambda: fn(ids, params))
                    if (name, i) not in best or seconds < best[name, i][1]:
                        best[name, i] = result, seconds
                    bar.update()
    return {name: [record(i, ids, *best[name, i], tokenizer) for i, ids in enumerate(prompt_ids)] for name in methods}


def record(index, ids, result: Generation, seconds, tokenizer) -> dict:
    n = len(result.output_ids)
    acc = result.acceptance_lengths
    return {
        "index": index,
        "prompt_tokens": len(ids),
        "output_tokens": n,
        "seconds": seconds,
        "tokens_per_s": n / seconds,
        "ttft_s": result.ttft,
        # TPOT's inverse (tokens after the first over the time after it): the decoding speed without prefill
        "decode_tokens_per_s": (n - 1) / (seconds - result.ttft) if n > 1 and seconds > result.ttft else None,
        "tau": mean_or_none(acc),
        "acceptance_lengths": acc,
        "matches_target": None,  # filled in by compare() for greedy runs with an hf baseline
        "first_divergence": None,
        "spec_stats": result.stats.to_dict() if result.stats is not None else None,
        "output_ids": result.output_ids,
        "text": tokenizer.decode(result.output_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False),
    }


def run_batch(cfg: BenchConfig, s: Setup, records) -> dict:
    """N concurrent requests in one engine, per batchable method: aggregate tokens/s vs one at a time."""
    n = cfg.batch_size
    indices = [i % len(s.prompt_ids) for i in range(n)]
    prompts, params = [s.prompt_ids[i] for i in indices], [sampling_params(cfg, i) for i in indices]
    warmup = [WARMUP_PROMPT.token_ids(s.tokenizer)] * n
    out = {}
    for name in [m for m in BATCHABLE if m in s.engines]:
        config = replace(s.engines[name], max_slots=n)
        engine = build_engine(config, s.loaded)
        engine.generate_batch(warmup, [replace(p, max_tokens=WARMUP_TOKENS) for p in params])
        batched = [replace(p, block_size=config.block_size) for p in params]
        runs = []
        for _ in range(cfg.repeats):
            fresh_state(engine)
            runs.append(timed(lambda: engine.generate_batch(prompts, batched)))
        requests, seconds = min(runs, key=lambda run: run[1])
        single = [records[name][i] for i in indices]
        tokens = sum(len(r.output_ids) for r in requests)
        single_tps = sum(r["output_tokens"] for r in single) / sum(r["seconds"] for r in single)
        same = [r.output_ids == one["output_ids"] for r, one in zip(requests, single)]
        out[name] = {
            "tokens": tokens,
            "seconds": seconds,
            "aggregate_tokens_per_s": tokens / seconds,
            "single_tokens_per_s": single_tps,
            "ratio": tokens / seconds / single_tps,
            "tau": mean_or_none([a for r in requests for a in r.acceptance_lengths])
            if engine.drafter is not None or engine.suffix is not None else None,
            "matches_single": all(same) if cfg.greedy else None,
            "match_rate_single": sum(same) / n if cfg.greedy else None,
        }
    return {"batch_size": n, "methods": out}


# ---- metrics ----------------------------------------------------------------------------------


def mean_or_none(xs):
    return sum(xs) / len(xs) if xs else None


def median_or_none(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def until_stop(ids, stops) -> list[int]:
    """Tokens before the first stop token."""
    for j, t in enumerate(ids):
        if t in stops:
            return ids[:j]
    return ids


def first_divergence(a, b) -> int | None:
    if a == b:
        return None
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summarize(recs: list[dict], base: list[dict] | None, greedy: bool, stops) -> dict:
    tokens = sum(r["output_tokens"] for r in recs)
    seconds = sum(r["seconds"] for r in recs)
    tps = tokens / seconds
    acc = [a for r in recs if r["acceptance_lengths"] for a in r["acceptance_lengths"]]
    summary = {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tps,
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs),
        "median_ttft_s": statistics.median(r["ttft_s"] for r in recs),
        "median_decode_tokens_per_s": median_or_none([r["decode_tokens_per_s"] for r in recs]),
        "speedup": None,
        "median_speedup": None,
        "median_decode_speedup": None,
        "tau": mean_or_none(acc) if recs[0]["acceptance_lengths"] is not None else None,
        "matches_target": None,
        "match_rate": None,
        "first_divergence": None,
    }
    if base is not None:
        base_tps = sum(r["output_tokens"] for r in base) / sum(r["seconds"] for r in base)
        summary["speedup"] = tps / base_tps
        summary["median_speedup"] = paired_ratio(recs, base)
        summary["median_decode_speedup"] = median_or_none(prompt_ratios(recs, base, "decode_tokens_per_s"))
        if greedy:
            summary.update(compare(recs, base, stops))
    return dict(summary, prompts=recs)


def compare(recs: list[dict], base: list[dict], stops) -> dict:
    """Greedy exactness against the baseline, outputs cut at the first stop token; marks each record."""
    div = [first_divergence(until_stop(r["output_ids"], stops), until_stop(b["output_ids"], stops)) for r, b in zip(recs, base)]
    for r, d in zip(recs, div):
        r["first_divergence"], r["matches_target"] = d, d is None
    same = [d is None for d in div]
    return {"matches_target": all(same), "match_rate": sum(same) / len(same), "first_divergence": div}


def prompt_ratios(a: list[dict], b: list[dict], key: str = "tokens_per_s") -> list[float]:
    """a's tokens/s over b's, prompt by prompt (each prompt measured side by side); with key
    "decode_tokens_per_s" over the prompts where both decoded more than their first token."""
    return [x[key] / y[key] for x, y in zip(a, b) if x[key] is not None and y[key] is not None]


def paired_ratio(a: list[dict], b: list[dict]) -> float:
    """Median over prompts of a's tokens/s over b's."""
    return statistics.median(prompt_ratios(a, b))


def ratio_summary(ratios: list[float]) -> str:
    ci = geomean_interval(ratios)
    return f"{statistics.median(ratios):.2f}x (geometric mean {ci['geomean']:.2f}x, 95% {ci['low']:.2f}-{ci['high']:.2f})"


def key_ratios(methods: dict, batch: dict | None) -> list[str]:
    """The headline ratios (medians over prompts of paired tokens/s ratios), each with the geometric mean
    over prompts and its 95% bootstrap interval."""
    p = {name: m["prompts"] for name, m in methods.items()}
    out = []
    pairs = (("ar", "hf"), ("dflash", "zlab"), ("dflash", "hf"), ("zlab", "hf"), ("dflash+suffix", "ar"),
             ("dflash+suffix", "dflash-adaptive"), ("dflash+suffix", "hf-lookup"), ("suffix", "hf-lookup"),
             ("dflash-adaptive", "dflash-chain"))
    for a, b in pairs:
        if a in p and b in p:
            ratios, decode = prompt_ratios(p[a], p[b]), prompt_ratios(p[a], p[b], "decode_tokens_per_s")
            out.append(f"{a}/{b} {ratio_summary(ratios)}" + (f"; decoding alone {ratio_summary(decode)}" if decode else ""))
    fixed = [n for n in p if n == "dflash" or n.startswith("dflash-b")]
    if "dflash-adaptive" in p and fixed:
        best = max(fixed, key=lambda n: methods[n]["tokens_per_s"])
        out.append(f"dflash-adaptive/best fixed ({best}) {paired_ratio(p['dflash-adaptive'], p[best]):.2f}x")
    if batch and batch["methods"]:
        name = "dflash" if "dflash" in batch["methods"] else next(iter(batch["methods"]))
        out.append(f"batch-{batch['batch_size']} aggregate/single ({name}) {batch['methods'][name]['ratio']:.2f}x")
    return out


# ---- report -----------------------------------------------------------------------------------


def fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def table(methods: dict, batch: dict | None) -> str:
    rows = [("method", "tok/s", "median tok/s", "speedup", "median speedup", "TTFT ms", "decode tok/s",
             "decode speedup", "tau", "match")]
    for name, m in methods.items():
        match = "-" if m["match_rate"] is None else f"{m['match_rate'] * len(m['prompts']):.0f}/{len(m['prompts'])}"
        rows.append((name, fmt(m["tokens_per_s"], ".1f"), fmt(m["median_tokens_per_s"], ".1f"), fmt(m["speedup"]),
                     fmt(m["median_speedup"]), fmt(m["median_ttft_s"] * 1000, ".0f"),
                     fmt(m["median_decode_tokens_per_s"], ".1f"), fmt(m["median_decode_speedup"]), fmt(m["tau"]), match))
    if batch:
        for name, b in batch["methods"].items():
            rows.append((f"{name} x{batch['batch_size']}", fmt(b["aggregate_tokens_per_s"], ".1f"), "", "", "", "", "",
                         "", fmt(b["tau"]), f"vs single {b['ratio']:.2f}x"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows)


def machine() -> dict:
    import transformers

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
    return info


def plot(report: dict, path):
    """Bar chart of tokens/s per method, tau written on the bars (Agg backend, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(report["methods"])
    tps = [report["methods"][n]["tokens_per_s"] for n in names]
    fig = Figure(figsize=(max(5, 1.1 * len(names) + 2), 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bars = ax.bar(names, tps, color=["#999999" if n.startswith("hf") else "#3a7dc9" for n in names])
    for bar, n in zip(bars, names):
        tau = report["methods"][n]["tau"]
        label = f"{bar.get_height():.1f}" + ("" if tau is None else f"\nτ={tau:.2f}")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    c = report["config"]
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{Path(c['target_path']).name}, {c['dtype_resolved']}, {c['engine']['device']}, T={c['temperature']}, "
                 f"{c['num_prompts_run']} prompts x {c['max_new_tokens']} tokens", fontsize=9)
    ax.margins(y=0.2)
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(cfg: BenchConfig) -> dict:
    """Run the benchmark, print the table and key ratios, write --json and --plot; returns the report."""
    torch.manual_seed(cfg.seed)
    prompts = load_prompts(cfg)
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        s = setup(cfg, prompts, Path(tmp))
        for note in s.notes:
            print(f"note: {note}")
        records = time_methods(s.methods, s.prompt_ids, cfg, s.tokenizer)
    stops = set(stop_token_ids(s.loaded.target_path))
    base = records.get("hf")
    methods = {name: summarize(recs, base, cfg.greedy, stops) for name, recs in records.items()}
    batch = run_batch(cfg, s, records) if cfg.batch_size else None
    config = dict(asdict(cfg), target_path=str(s.loaded.target_path), drafter=s.loaded.drafter_name,
                  dtype_resolved=str(s.loaded.dtype).removeprefix("torch."), block_size_resolved=s.block_size,
                  num_prompts_run=len(prompts), timing="per (method, prompt): fastest of --repeats sweeps",
                  notes=s.notes, machine=machine())
    report = {"config": config, "methods": methods, "batch": batch}
    print(table(methods, batch))
    print("key ratios (median over prompts): " + ("; ".join(key_ratios(methods, batch)) or "n/a"))
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(report, indent=1) + "\n")
    if cfg.plot:
        plot(report, cfg.plot)
    return report
