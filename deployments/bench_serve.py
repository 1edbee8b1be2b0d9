"""Serving benchmark: the OpenAI server under a concurrency sweep, measured by real HTTP streaming
clients, side by side with the same server without speculation and with the in-process engine.

`dflash-serve bench-serve` starts a loopback Ray cluster (or deploys into the caller's, or attaches
to a running server with --url), deploys two applications from the same code path (speculation on:
the configured drafter; off: draft="none"), sends closed-loop streaming chat requests at each
concurrency level (N clients, each sending its next request when the previous one ends) and runs
the same prompts through an in-process Engine with the same settings, N requests at a time in one
generate_batch. Levels are the outer loop and variants the inner one, so the runs that are
compared sit close in time on a shared machine. It prints a table and the key ratios and writes
JSON and a plot, with the conventions of engine/bench.py.

Definitions (per request, then p50/p90/p99 over the level's requests):
  TTFT  from sending the request to the first SSE event (the server sends nothing before the first
        text is ready); in-process: from admission (add_request) to the first committed token.
  ITL   gaps between consecutive events that carry text; with speculation one event can carry
        several tokens, as in vLLM's benchmark_serving; in-process: gaps between steps that
        committed tokens for the request.
  TPOT  (end-to-end latency - TTFT) / (output tokens - 1).
  tok/s output tokens of the level / wall time of the level (aggregate over clients).
  MAL   mean acceptance length = 1 + accepted / drafts, summed over the level's requests
        (from usage.spec_decoding); "-" without speculation.
Ray and HTTP imports are inside functions: `dflash-serve bench-serve --help` needs neither.
"""

import asyncio
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from deployments.config import AppConfig
from engine.config import EngineConfig
from engine.prompts import DEFAULT_PROMPTS, chat

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("server", "server-disagg", "server-nospec", "in-process")
APP_NAMES = {"server": "bench-serve-spec", "server-disagg": "bench-serve-disagg", "server-nospec": "bench-serve-nospec"}
ROUTES = {"server": "/bench-spec", "server-disagg": "/bench-disagg", "server-nospec": "/bench-nospec"}
RAY_CPUS = 2  # what this machine has; a cluster this command starts declares at least what its apps reserve
WARMUP_PROMPT = chat("Hi!")
WARMUP_TOKENS = 4
PERCENTILES = (50, 90, 99)
DISAGGREGATED_NOTE = ("topology 'disaggregated' (separate drafter and verifier deployments): not measured; "
                      "add server-disagg to --variants")


@dataclass
class ServeBenchConfig:
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    num_requests: int = 8  # per concurrency level (and per variant)
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    variants: list[str] = field(default_factory=lambda: ["server", "server-nospec", "in-process"])
    num_prompts: int | None = None  # the first N built-in prompts; requests cycle through them
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_slots: int | None = None  # per replica (replaces the engine's); None: the largest concurrency level
    num_cpus: float = 1.0  # per engine replica; torch threads = round(num_cpus), also in-process
    url: str | None = None  # attach to this running server instead of deploying one
    request_timeout_s: float = 600.0
    json: str | None = None
    plot: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def app_config(self, variant: str) -> AppConfig:
        """The server application a variant deploys (speculation off: the same app with draft='none';
        server-disagg: topology 'disaggregated', the drafter replica sized like the verifier)."""
        gpus = 1 if self.engine.device.startswith("cuda") else 0
        draft = "none" if variant == "server-nospec" else self.engine.draft
        return AppConfig(
            engine=replace(self.engine, draft=draft, max_slots=self.max_slots or max(self.concurrency)), num_cpus=self.num_cpus,
            num_gpus=gpus, **({"topology": "disaggregated", "drafter_num_cpus": self.num_cpus, "drafter_num_gpus": gpus}
                              if variant == "server-disagg" else {}))

    def reserved_cpus(self, variant: str) -> float:
        return self.num_cpus * (2 if variant == "server-disagg" else 1)


def check_config(cfg: ServeBenchConfig) -> str | None:
    """What is wrong with cfg as a flag-naming message, or None; no model, no Ray."""
    if not cfg.concurrency or any(c < 1 for c in cfg.concurrency):
        return f"--concurrency must be a list of integers >= 1, got {cfg.concurrency}"
    if cfg.num_requests < 1:
        return f"--num-requests must be >= 1, got {cfg.num_requests}"
    if cfg.max_tokens < 1:
        return f"--max-tokens must be >= 1, got {cfg.max_tokens}"
    unknown = [v for v in cfg.variants if v not in VARIANTS]
    if unknown or not cfg.variants:
        return f"--variants: unknown or none: {', '.join(unknown) or '(empty)'}; choose from {', '.join(VARIANTS)}"
    if cfg.engine.draft == "none" and "server-nospec" in cfg.variants:
        return "--draft none: the server is already without speculation; drop server-nospec from --variants"
    if cfg.num_prompts is not None and not 1 <= cfg.num_prompts <= len(DEFAULT_PROMPTS):
        return f"--num-prompts must be in 1..{len(DEFAULT_PROMPTS)}, got {cfg.num_prompts}"
    if cfg.url is not None and not cfg.url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
        return f"--url must be a loopback address (http://127.0.0.1:PORT), got {cfg.url}"
    servers = [v for v in cfg.variants if v in APP_NAMES]
    if cfg.url is not None and "server-disagg" in servers:
        return "--url: server-disagg deploys its own app; drop it from --variants when attaching to a server"
    for dest in ("json", "plot"):
        path = getattr(cfg, dest)
        if path is not None and not Path(path).resolve().parent.is_dir():
            return f"--{dest} {path}: the folder {Path(path).resolve().parent} does not exist"
    if cfg.plot is not None and not cfg.plot.lower().endswith(".png"):
        return f"--plot must be a .png path, got {cfg.plot}"
    try:
        for v in servers:
            cfg.app_config(v)
    except ValueError as e:  # pydantic's message names the field
        return " ".join(str(e).split())
    return None


# ---- per-request records and level summaries ----------------------------------------------------


@dataclass
class RequestRecord:
    index: int  # which request of the level (prompt index = index % number of prompts)
    start: float  # perf_counter seconds
    first: float | None = None  # first event / first committed token
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # events / steps that carried text
    output_tokens: int = 0
    num_drafts: int = 0
    num_accepted: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


def percentiles(xs: list[float]) -> dict | None:
    if not xs:
        return None
    s = sorted(xs)

    def at(p):  # linear interpolation, as numpy's default
        k = (len(s) - 1) * p / 100
        lo = int(k)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {f"p{p}": at(p) for p in PERCENTILES} | {"mean": statistics.fmean(s)}


def summarize_level(records: list[RequestRecord], seconds: float, speculative: bool) -> dict:
    ok = [r for r in records if r.error is None]
    tokens = sum(r.output_tokens for r in ok)
    drafts = sum(r.num_drafts for r in ok)
    ttft = [r.first - r.start for r in ok if r.first is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = [(r.end - r.first) / (r.output_tokens - 1) for r in ok if r.first is not None and r.output_tokens > 1]
    e2e = [r.end - r.start for r in ok]
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_messages": sorted({r.error for r in records if r.error is not None}),
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tokens_per_s": tokens / seconds if seconds > 0 else None,
        "requests_per_s": len(ok) / seconds if seconds > 0 else None,
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
        "tpot_s": percentiles(tpot),
        "e2e_s": percentiles(e2e),
        "mean_acceptance_length": 1 + sum(r.num_accepted for r in ok) / drafts if speculative and drafts else None,
        "num_drafts": drafts,
        "match_in_process": None,  # filled in when greedy and the in-process variant ran
        "requests": [{"index": r.index, "output_tokens": r.output_tokens, "ttft_s": None if r.first is None else
                      r.first - r.start, "e2e_s": None if r.end is None else r.end - r.start,
                      "finish_reason": r.finish_reason, "error": r.error, "text": r.text} for r in records],
    }


# ---- HTTP clients -------------------------------------------------------------------------------


def request_body(cfg: ServeBenchConfig, prompt, index: int, max_tokens: int, model: str | None) -> dict:
    body = {"messages": [m.model_dump() for m in prompt.messages], "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": cfg.temperature, "top_p": cfg.top_p,
            "seed": cfg.seed + index}
    if cfg.top_k:
        body["top_k"] = cfg.top_k
    if model:
        body["model"] = model
    return body


async def stream_one(client, url: str, body: dict, record: RequestRecord):
    """One streaming chat completion into `record` (errors are recorded, never raised)."""
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now, data = time.perf_counter(), line[6:]
                if data == "[DONE]":  # read on to the end of the body, so the connection is reused
                    continue
                event = json.loads(data)
                if "error" in event:
                    record.error = f"stream error: {event['error'].get('message')}"
                    return
                if record.first is None:
                    record.first = now
                for choice in event.get("choices") or []:
                    content = choice.get("delta", {}).get("content") or ""
                    if content:
                        record.text += content
                        record.chunk_times.append(now)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                usage = event.get("usage")
                if usage:
                    record.output_tokens = usage["completion_tokens"]
                    spec = usage.get("spec_decoding") or {}
                    record.num_drafts = spec.get("num_drafts", 0)
                    record.num_accepted = spec.get("num_accepted_tokens", 0)
        record.end = time.perf_counter()
        if record.finish_reason is None:
            record.error = "the stream ended without a finish reason"
    except Exception as e:  # a failed request is counted, and the level goes on
        record.error = f"{type(e).__name__}: {e}"


async def closed_loop(url: str, bodies: list[dict], concurrency: int, timeout_s: float, bar=None):
    """`concurrency` clients, each sending the next body when its previous request ends;
    (records in body order, wall seconds from the first send to the last end)."""
    import httpx

    records: list[RequestRecord | None] = [None] * len(bodies)
    queue = list(range(len(bodies)))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30), limits=limits) as client:
        async def worker():
            while queue:
                i = queue.pop(0)
                records[i] = RequestRecord(i, time.perf_counter())
                await stream_one(client, url, bodies[i], records[i])
                if bar is not None:
                    bar.update()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records, time.perf_counter() - start


class ServerVariant:
    """A server (deployed by this run or given by --url) and how its requests differ."""

    def __init__(self, name: str, url: str, cfg: ServeBenchConfig, extra: dict | None = None):
        self.name, self.url, self.cfg, self.extra = name, url, cfg, extra or {}

    def bodies(self, prompts, indices: list[int], max_tokens: int) -> list[dict]:
        return [request_body(self.cfg, prompts[i % len(prompts)], i, max_tokens, None) | self.extra for i in indices]

    def run_level(self, prompts, concurrency: int, bar) -> dict:
        warm = self.bodies([WARMUP_PROMPT], list(range(concurrency)), WARMUP_TOKENS)
        asyncio.run(closed_loop(self.url, warm, concurrency, self.cfg.request_timeout_s))
        bodies = self.bodies(prompts, list(range(self.cfg.num_requests)), self.cfg.max_tokens)
        records, seconds = asyncio.run(closed_loop(self.url, bodies, concurrency, self.cfg.request_timeout_s, bar))
        return summarize_level(records, seconds, speculative=self.extra.get("block_size") != 1
                               and self.name != "server-nospec")


# ---- the in-process engine ------------------------------------------------------------------------


class InProcessVariant:
    """The server's engine built in this process (same loading, policy, context length and threads),
    a level's requests run `concurrency` at a time by Engine.generate_batch; steps are timed."""

    name = "in-process"

    def __init__(self, cfg: ServeBenchConfig):
        from engine.config import load_models

        self.cfg, self.config = cfg, cfg.app_config("server")
        self.threads = self.config.torch_threads
        with torch_threads(self.threads):
            self.loaded = load_models(self.config.engine)
        self.max_block = self.config.engine.max_block_size(self.loaded.drafter)
        self.tokenizer = self.loaded.tokenizer

    def params(self, index: int, max_tokens: int):
        from engine.engine import SamplingParams

        c = self.cfg
        return SamplingParams(max_tokens=max_tokens, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                              seed=c.seed + index, block_size=self.max_block)

    def run_level(self, prompts, concurrency: int, bar) -> dict:
        from engine.config import build_engine

        with torch_threads(self.threads):
            engine = build_engine(replace(self.config.engine, max_slots=concurrency), self.loaded)
            warm = WARMUP_PROMPT.token_ids(self.tokenizer)
            engine.generate_batch([warm] * concurrency, [self.params(i, WARMUP_TOKENS) for i in range(concurrency)])
            n = self.cfg.num_requests
            ids = [prompts[i % len(prompts)].token_ids(self.tokenizer) for i in range(n)]
            records = timed_generate_batch(engine, ids, [self.params(i, self.cfg.max_tokens) for i in range(n)],
                                           self.decode)
        for r in records:
            bar.update()
        seconds = max(r.end for r in records) - min(r.start for r in records)
        return summarize_level(records, seconds, speculative=self.loaded.drafter is not None)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def timed_generate_batch(engine, prompt_ids: list[list[int]], params: list, decode) -> list[RequestRecord]:
    """Engine.generate_batch itself, with add_request and step wrapped on this instance to time each
    request's admission and every step that commits tokens for it."""
    records: dict[int, RequestRecord] = {}
    add_request, step = engine.add_request, engine.step

    def timed_add(ids, p):
        request = add_request(ids, p)
        records[request.request_id] = RequestRecord(len(records), time.perf_counter())
        return request

    def timed_step():
        outputs = step()
        now = time.perf_counter()
        for out in outputs:
            r = records.get(out.request_id)
            if r is None:
                continue
            if out.new_token_ids:
                r.first = r.first or now
                r.chunk_times.append(now)
            if out.finish_reason is not None:
                r.end, r.finish_reason = now, out.finish_reason
        return outputs

    engine.add_request, engine.step = timed_add, timed_step
    try:
        done = engine.generate_batch(prompt_ids, params)
    finally:
        del engine.add_request, engine.step
    out = []
    for request in done:
        r = records[request.request_id]
        r.output_tokens = len(request.output_ids)
        r.num_drafts, r.num_accepted = request.stats.num_drafts, request.stats.num_accepted_tokens
        r.text = decode(request.output_ids)
        r.end = r.end or time.perf_counter()
        out.append(r)
    return sorted(out, key=lambda r: r.index)


class torch_threads:
    """Run a block with n torch threads (the replica's), then restore the caller's."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)


# ---- servers: start Ray, deploy, attach ------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(num_cpus: int = RAY_CPUS) -> str:
    """A fresh local Ray cluster on loopback with Serve's proxy on a free 127.0.0.1 port; its URL."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read when ray is imported: else Ray 2.60 binds the external address
    import ray
    from ray import serve

    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": python_path}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def deploy(cfg: ServeBenchConfig, cluster_url: str, variants: list[str], timeout_s: float = 300) -> dict[str, str]:
    """Deploy each server variant as its own application and route prefix; {variant: base URL}."""
    urls = deploy_apps({APP_NAMES[v]: (ROUTES[v], cfg.app_config(v)) for v in variants}, cluster_url, timeout_s)
    return {v: urls[APP_NAMES[v]] for v in variants}


def deploy_apps(apps: dict[str, tuple[str, AppConfig]], cluster_url: str, timeout_s: float = 300) -> dict[str, str]:
    """Deploy {app name: (route prefix, config)} one after the other into the running cluster (so a
    replica's start-up, e.g. the adaptive policy's profiling, has the machine to itself); returns
    {app name: base URL} once every app answers /health."""
    import httpx
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.launch import reserved_cpus

    need = sum(reserved_cpus(config) for _, config in apps.values())
    free = ray.available_resources().get("CPU", 0)
    if need > free + 1e-9:
        raise ValueError(f"the server apps need {need:g} CPUs but the Ray cluster has {free:g} free; "
                         f"lower --num-cpus")
    for name, (route, config) in apps.items():
        serve.run(build_app(config), name=name, route_prefix=route)  # waits until running
    urls = {name: cluster_url + route for name, (route, _) in apps.items()}
    deadline = time.monotonic() + timeout_s
    for name, url in urls.items():
        while True:
            status = serve.status().applications.get(name)
            if status is not None and status.status == "DEPLOY_FAILED":
                raise RuntimeError(f"{name} failed to deploy: {status.message}")
            try:
                if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} was not healthy after {timeout_s:.0f} s")
            time.sleep(0.5)
    return urls


def server_info(url: str, api_key: str | None = None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        health = httpx.get(f"{url}/health", timeout=30).json()
        model = httpx.get(f"{url}/v1/models", timeout=30, headers=headers).json()["data"][0]
        return {"model": model.get("id"), "drafter": model.get("drafter"), "max_block_size":
                model.get("max_block_size"), "max_model_len": model.get("max_model_len"), "slots":
                health.get("engine", {}).get("total")}
    except Exception as e:  # informational only
        return {"error": f"{type(e).__name__}: {e}"}


# ---- report ------------------------------------------------------------------------------------------


def fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def pct(stats: dict | None, scale=1000.0, spec=".0f") -> str:
    return "-" if stats is None else "/".join(format(stats[f"p{p}"] * scale, spec) for p in PERCENTILES)


def table(results: dict) -> str:
    rows = [("variant", "conc", "ok/err", "out tok/s", "req/s", "TTFT ms p50/90/99", "ITL ms p50/90/99",
             "TPOT ms p50/90/99", "E2E s p50/90/99", "MAL", "match")]
    for name, levels in results.items():
        for c, m in levels.items():
            match = "-" if m["match_in_process"] is None else f"{m['match_in_process'] * m['completed']:.0f}/" \
                                                               f"{m['completed']}"
            rows.append((name, str(c), f"{m['completed']}/{m['errors']}", fmt(m["output_tokens_per_s"], ".1f"),
                         fmt(m["requests_per_s"]), pct(m["ttft_s"]), pct(m["itl_s"]), pct(m["tpot_s"], spec=".1f"),
                         pct(m["e2e_s"], 1.0, ".2f"), fmt(m["mean_acceptance_length"]), match))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def key_ratios(results: dict, concurrency: list[int]) -> dict:
    """server/in-process at the lowest concurrency, tok/s at the highest vs the lowest, spec on/off at the
    highest (output tokens/s ratios; None where a variant did not run)."""
    lo, hi = min(concurrency), max(concurrency)

    def tps(variant, c):
        return results.get(variant, {}).get(c, {}).get("output_tokens_per_s")

    def ratio(a, b):
        return a / b if a and b else None

    out = {f"server/in-process @{lo}": ratio(tps("server", lo), tps("in-process", lo))}
    for v in results:
        out[f"{v} @{hi}/@{lo}"] = ratio(tps(v, hi), tps(v, lo))
    out[f"spec on/off (server) @{hi}"] = ratio(tps("server", hi), tps("server-nospec", hi))
    out[f"disaggregated/in-process @{lo}"] = ratio(tps("server-disagg", lo), tps("in-process", lo))
    out[f"disaggregated/colocated @{hi}"] = ratio(tps("server-disagg", hi), tps("server", hi))
    if hi != lo:
        out[f"server/in-process @{hi}"] = ratio(tps("server", hi), tps("in-process", hi))
    return out


def plot(report: dict, path):
    """Output tokens/s and TTFT p50 against concurrency, one line per variant (Agg, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_tps, ax_ttft = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name, levels in report["results"].items():
        cs = [int(c) for c in levels]
        ax_tps.plot(cs, [levels[c]["output_tokens_per_s"] or 0 for c in levels], marker="o", label=name)
        ttft = [(levels[c]["ttft_s"] or {}).get("p50") for c in levels]
        ax_ttft.plot([c for c, t in zip(cs, ttft) if t is not None], [t * 1000 for t in ttft if t is not None],
                     marker="o", label=name)
    for ax, label in ((ax_tps, "output tokens/s (aggregate)"), (ax_ttft, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["config"]["concurrency"], [str(c) for c in report["config"]["concurrency"]])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    c = report["config"]
    fig.suptitle(f"{Path(c['target_path']).name}, drafter {c['drafter']}, {c['dtype_resolved']}, {c['engine']['device']}, "
                 f"T={c['temperature']}, {c['num_requests']} requests x {c['max_tokens']} tokens per level "
                 f"(server: colocated; server-disagg: disaggregated)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def machine() -> dict:
    from engine.bench import machine as engine_machine

    return engine_machine()


# ---- the run -------------------------------------------------------------------------------------------


def run(cfg: ServeBenchConfig, cluster_url: str | None = None) -> dict:
    """Run the sweep, print the table and key ratios, write --json and --plot; returns the report.

    Servers: cfg.url attaches to a running server (speculation off is then per request, block_size=1);
    else with `cluster_url` (the caller's Serve proxy; Ray already initialised) the server apps are
    deployed into that cluster and deleted at the end; else this starts a loopback Ray cluster with
    RAY_CPUS CPUs and shuts it down at the end."""
    problem = check_config(cfg)
    if problem:
        raise ValueError(problem)
    prompts = DEFAULT_PROMPTS[: cfg.num_prompts]
    notes = [] if "server-disagg" in cfg.variants else [DISAGGREGATED_NOTE]
    servers = [v for v in cfg.variants if v in APP_NAMES]
    owned_cluster, deployed = False, []
    try:
        variants: dict[str, object] = {}
        if servers and cfg.url:
            notes.append("--url: attached to a running server; server-nospec is that server with per-request "
                         "block_size=1; the in-process engine uses this command's model flags")
            for v in servers:
                variants[v] = ServerVariant(v, cfg.url.rstrip("/"), cfg, {"block_size": 1} if v == "server-nospec"
                                            else {})
        elif servers:
            if cluster_url is None:
                need = sum(cfg.reserved_cpus(v) for v in servers)
                cluster_url, owned_cluster = start_cluster(max(RAY_CPUS, math.ceil(need))), True
                if need > RAY_CPUS:
                    notes.append(f"the cluster declares {math.ceil(need)} CPUs for the apps' reservations on a "
                                 f"{os.cpu_count()}-CPU machine; only one app is under load at a time")
            deployed = servers
            urls = deploy(cfg, cluster_url, servers)
            variants.update({v: ServerVariant(v, urls[v], cfg) for v in servers})
        if "in-process" in cfg.variants:
            variants["in-process"] = InProcessVariant(cfg)
            notes.append(f"in-process: the replica's engine settings in this process, {variants['in-process'].threads} "
                         f"torch thread(s) like a replica; N requests at a time in one Engine.generate_batch")
        info = {v: server_info(s.url) for v, s in variants.items() if isinstance(s, ServerVariant)}
        inproc = variants.get("in-process")
        results: dict[str, dict[int, dict]] = {v: {} for v in variants}
        total = len(cfg.concurrency) * len(variants) * cfg.num_requests
        with tqdm(total=total, desc="bench-serve", unit="req") as bar:
            for c in cfg.concurrency:
                for name, variant in variants.items():
                    bar.set_postfix_str(f"{name} x{c}")
                    results[name][c] = variant.run_level(prompts, c, bar)
        if inproc is not None and cfg.greedy:
            compare_outputs(results)
            notes.append("match: greedy text per request against the in-process engine (speculation on); 'server' "
                         "must match exactly. server-nospec decodes one token per forward, which in bfloat16 rounds "
                         "differently from verifying a block (and batch shapes differ), so some greedy paths may "
                         "diverge there; in float32 they match")
        config = dict(asdict(cfg), num_prompts_run=len(prompts), prompts="engine.prompts.DEFAULT_PROMPTS (chat)",
                      servers=info, notes=notes, machine=machine(),
                      topologies={"colocated": "measured" if "server" in cfg.variants else "not measured",
                                  "disaggregated": "measured" if "server-disagg" in cfg.variants else
                                  "not measured (add server-disagg to --variants)"})
        if inproc is not None:
            config.update(target_path=str(inproc.loaded.target_path), drafter=inproc.loaded.drafter_name,
                          dtype_resolved=str(inproc.loaded.dtype).removeprefix("torch."),
                          block_size_resolved=inproc.max_block, torch_threads=inproc.threads)
        else:
            first = next(iter(info.values()), {})
            config.update(target_path=str(first.get("model")), drafter=first.get("drafter"),
                          dtype_resolved=cfg.engine.dtype, block_size_resolved=first.get("max_block_size"))
        report = {"config": config, "results": results, "key_ratios": key_ratios(results, cfg.concurrency)}
    finally:
        if deployed:
            from ray import serve

            for v in deployed:
                serve.delete(APP_NAMES[v])
        if owned_cluster:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    for note in notes:
        print(f"note: {note}")
    print(table(report["results"]))
    ratios = "; ".join(f"{k} {v:.2f}x" for k, v in report["key_ratios"].items() if v is not None)
    print("key ratios (output tokens/s): " + (ratios or "n/a"))
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(report, indent=1) + "\n")
    if cfg.plot:
        plot(report, cfg.plot)
    return report


def compare_outputs(results: dict):
    """Greedy: each server variant's text per request against the in-process engine's."""
    for name, levels in results.items():
        if name == "in-process":
            continue
        for c, m in levels.items():
            want = {r["index"]: r["text"] for r in results["in-process"].get(c, {}).get("requests", [])}
            got = [r for r in m["requests"] if r["error"] is None and r["index"] in want]
            same = [r["text"] == want[r["index"]] for r in got]
            m["match_in_process"] = sum(same) / len(same) if same else None
            m["mismatched_requests"] = [r["index"] for r, s in zip(got, same) if not s]
