"""Metrics end to end: both topologies on the session's Ray cluster, Debian's Prometheus (installed by
scripts/setup.sh) scraping Ray's metrics agent with cluster/prometheus.yml, traffic through the openai
client, then PromQL. The speculative counters must equal the sums of the responses' `usage`, the mean
acceptance length from PromQL must equal the one from `usage` within 1%, and every query of every
dashboard panel must return data.

A drafter that accepts something is needed for those numbers to mean anything, and no trained one
ships yet: the test builds a real (z-lab format) drafter whose layers add nothing, so it always
proposes its mask token, 29 ("-"). After a run of "-" SmolLM2 keeps writing "-" (every draft is
accepted), after "!" it writes a few then newlines (some are), after a chat prompt none are.
"""

import concurrent.futures
import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from ray import serve

from conftest import ROOT, deploy, free_port, openai_client
from deployments.app import build_app
from deployments.config import AppConfig
from deployments.dashboards import build_dashboard, panel_queries, query_range

pytestmark = pytest.mark.slow

REPEAT_TOKEN = 29  # "-"
PROMPTS = [[REPEAT_TOKEN] * 48, [17] * 48, "Write a haiku about the sea."]  # all, some, no drafts accepted
MAX_TOKENS = 24
NUM_ROUNDS = int(os.environ.get("DFLASH_METRICS_ROUNDS", 2))  # of PROMPTS, per topology, 3 at a time
TOPOLOGIES = {  # name -> (application, route prefix, config); both fit the session's 2 CPUs together
    "colocated": ("metrics-colocated", "/m-colo", dict(num_cpus=1, max_slots=4)),
    "disaggregated": ("metrics-disagg", "/m-disagg", dict(
        topology="disaggregated", num_cpus=0.5, drafter_num_cpus=0.5, max_slots=4)),
}


def promql(url: str, query: str) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=30)
    assert r.status_code == 200, f"{query}: {r.text}"
    return r.json()["data"]["result"]


def scalar(url: str, query: str) -> float | None:
    result = promql(url, query)
    return float(result[0]["value"][1]) if result else None


def fill(expr: str, application: str, model: str, window: str) -> str:
    return expr.replace("$application", application).replace("$model", model).replace("$__rate_interval", window)


# ---- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repeat_drafter(tmp_path_factory) -> str:
    """A z-lab-format drafter that always drafts token REPEAT_TOKEN: attention and MLP outputs zeroed,
    so a mask position's hidden state is the embedding of the mask token, REPEAT_TOKEN."""
    import torch

    from engine.default_model import resolve_model_path
    from engine.drafter import save_drafter
    from engine.loading import random_drafter
    from engine.model import ModelConfig

    path = tmp_path_factory.mktemp("repeat-drafter")
    target = ModelConfig.from_hf(json.loads((resolve_model_path(None) / "config.json").read_text()))
    drafter = random_drafter(target, num_layers=1, block_size=8)
    drafter.config.mask_token_id = REPEAT_TOKEN
    for layer in drafter.layers:
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
        torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    save_drafter(drafter, path, dtype=torch.float32)
    return str(path)


@pytest.fixture(scope="module")
def prometheus(serve_cluster, tmp_path_factory):
    """Debian's prometheus on 127.0.0.1 with cluster/prometheus.yml, scraping every second. The file
    it discovers Ray's metrics agents from is written by Ray's dashboard, which the test cluster runs
    without; so the test writes it, in Ray's format (ray/_private/metrics_agent.py), with loopback targets."""
    import ray

    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: run scripts/setup.sh (it apt-get installs Debian's prometheus)"
    folder = tmp_path_factory.mktemp("prometheus")
    ports = [node["MetricsExportPort"] for node in ray.nodes() if node["Alive"]]
    discovery = folder / "prom_metrics_service_discovery.json"
    discovery.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": [f"127.0.0.1:{p}" for p in ports]}]))
    config = yaml.safe_load((ROOT / "cluster" / "prometheus.yml").read_text())
    # Not faster: a scrape times out after one interval, and late in a test session the agent serves the
    # series of every deployment the session ran (counters are never dropped); CI saw every scrape of a
    # 1 s interval fail there (up == 0 throughout), standalone they take milliseconds.
    config["global"]["scrape_interval"] = config["global"]["scrape_timeout"] = "5s"
    (job,) = config["scrape_configs"]
    job["file_sd_configs"][0]["files"] = [str(discovery)]
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(folder / "prometheus.log", "w") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={folder / 'prometheus.yml'}",
             f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={folder / 'data'}"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not _ready(url):
            assert proc.poll() is None, f"prometheus exited: {(folder / 'prometheus.log').read_text()[-2000:]}"
            assert time.monotonic() < deadline, "prometheus never became ready"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _request(client, model: str, prompt) -> dict:
    """One request through the openai client; its usage (completion_tokens, spec_decoding)."""
    if isinstance(prompt, str):
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=MAX_TOKENS, temperature=0)
    else:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return {"completion_tokens": out.usage.completion_tokens, "prompt_tokens": out.usage.prompt_tokens,
            "cached_tokens": out.usage.prompt_tokens_details.cached_tokens, **out.usage.model_extra["spec_decoding"]}


@pytest.fixture(scope="module")
def load_run(serve_cluster, repeat_drafter, prometheus):
    """Both topologies deployed with the repeat drafter; one warm-up request each (so Prometheus sees
    every counter before it grows), then NUM_ROUNDS of PROMPTS, 3 at a time. Yields
    {topology: (application, model, [usage of every request])} and the run's start time. DFlash drafts
    only: the rounds repeat their prompts, so with suffix drafting on, every request after the first
    round copies its reply from the shared index, and the drafter (whose latency a panel shows) idles."""
    runs = {}
    for topology, (app, prefix, sizes) in TOPOLOGIES.items():
        config = AppConfig(policy="fixed", draft=repeat_drafter, dtype="float32", model_name=app,
                           proposers="dflash", **sizes)
        runs[topology] = (app, app, openai_client(deploy(build_app(config), app, serve_cluster, prefix)), [])
    start = time.time()
    try:
        for app, model, client, usages in runs.values():
            usages.append(_request(client, model, PROMPTS[0]))
        for app, model, _, _ in runs.values():
            _wait_for(prometheus, f'sum(ray_dflash_num_drafts_total{{model="{model}"}})',
                      lambda v: v is not None, "the warm-up's drafts")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            for app, model, client, usages in runs.values():
                usages += pool.map(lambda p: _request(client, model, p), PROMPTS * NUM_ROUNDS)
        yield {topology: (app, model, usages) for topology, (app, model, _, usages) in runs.items()}, start
    finally:
        for app, *_ in runs.values():
            serve.delete(app)


def _wait_for(url: str, query: str, ok, what: str, timeout_s: float = 120) -> float | None:
    """Poll a PromQL query until ok(value): Ray's agents export every 10 s, Prometheus scrapes every 5 s.
    On a timeout the message says how Prometheus's scrapes of the agents went."""
    deadline = time.monotonic() + timeout_s
    value = scalar(url, query)
    while not ok(value):
        if time.monotonic() >= deadline:
            targets = httpx.get(f"{url}/api/v1/targets", timeout=30).json()["data"]["activeTargets"]
            scrapes = [(t["scrapeUrl"], t["health"], t["lastError"], t["lastScrapeDuration"]) for t in targets]
            raise AssertionError(f"{what}: {query} = {value} after {timeout_s:.0f} s; scrapes: {scrapes}")
        time.sleep(1)
        value = scalar(url, query)
    return value


# ---- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_spec_counters_equal_usage_and_acceptance_length_within_one_percent(prometheus, load_run, topology):
    runs, _ = load_run
    app, model, usages = runs[topology]
    total = {k: sum(u[k] for u in usages) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                                     "completion_tokens", "prompt_tokens", "cached_tokens")}
    assert total["num_accepted_tokens"] > 0 and total["num_accepted_tokens"] < total["num_draft_tokens"]
    sel = f'model="{model}", application="{app}"'
    drafts = _wait_for(prometheus, f"sum(ray_dflash_num_drafts_total{{{sel}}})",
                       lambda v: v == total["num_drafts"], "num_drafts == sum of usage")
    assert scalar(prometheus, f"sum(ray_dflash_num_draft_tokens_total{{{sel}}})") == total["num_draft_tokens"]
    accepted = _wait_for(prometheus, f"sum(ray_dflash_num_accepted_tokens_total{{{sel}}})",
                         lambda v: v == total["num_accepted_tokens"], "num_accepted_tokens == sum of usage")
    _wait_for(prometheus, f"sum(ray_dflash_num_accepted_tokens_per_pos_total{{{sel}}})",
              lambda v: v == total["num_accepted_tokens"], "per-position counts add up to the accepted")
    _wait_for(prometheus, f"sum(ray_dflash_num_generated_tokens_total{{{sel}}})",
              lambda v: v == total["completion_tokens"], "generated tokens == sum of completion_tokens")
    _wait_for(prometheus, f"sum(ray_dflash_e2e_latency_seconds_count{{{sel}}})",
              lambda v: v == len(usages), "one end-to-end latency per request")
    _wait_for(prometheus, f"sum(ray_dflash_num_prompt_tokens_total{{{sel}}})",
              lambda v: v == total["prompt_tokens"], "prompt tokens == sum of prompt_tokens")
    _wait_for(prometheus, f"sum(ray_dflash_num_cached_prompt_tokens_total{{{sel}}}) or vector(0)",
              lambda v: v == total["cached_tokens"], "cached prompt tokens == sum of cached_tokens")
    if topology == "colocated":  # its rounds repeat the 48-token prompts: later ones start from the cache
        assert total["cached_tokens"] > 0

    from_usage = 1 + total["num_accepted_tokens"] / total["num_drafts"]
    from_counters = scalar(prometheus, f"1 + sum(ray_dflash_num_accepted_tokens_total{{{sel}}})"
                                       f" / sum(ray_dflash_num_drafts_total{{{sel}}})")
    from_histogram = scalar(prometheus, f"sum(ray_dflash_acceptance_length_sum{{{sel}}})"
                                        f" / sum(ray_dflash_acceptance_length_count{{{sel}}})")
    print(f"\n{topology}: mean acceptance length from usage {from_usage:.4f}, PromQL counters "
          f"{from_counters:.4f}, PromQL histogram {from_histogram:.4f} ({drafts:.0f} drafts, {accepted:.0f} accepted)")
    assert from_counters == pytest.approx(from_usage, rel=0.01)
    assert from_histogram == pytest.approx(from_usage, rel=0.01)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_dashboard_panel_query_returns_data(prometheus, load_run, topology):
    """Range queries over the run, as Grafana draws a panel. (An instant query can miss a gauge: Ray's
    agent drops a gauge value not re-exported within two export intervals, 20 s, and a busy 2-core CI
    host delays exports; Prometheus then marks the series stale until the next one.)"""
    runs, start = load_run
    app, model, usages = runs[topology]
    _wait_for(prometheus, f'sum(ray_dflash_e2e_latency_seconds_count{{model="{model}"}})',
              lambda v: v == len(usages), "every request recorded")
    # A rate needs two samples in its window, so the window spans the run: the warm-up's counts (which
    # the fixture waited for) and the last ones are both in it. A 5 m window once held no two samples
    # of the drafts counter in CI, late in the session, where scrapes of Ray's agent can time out.
    window = f"{int(time.time() - start) + 10}s"
    empty = []
    for title, expr in panel_queries(build_dashboard()):
        series = query_range(prometheus, fill(expr, app, model, window), start - 10, time.time(), step_s=2)
        values = [float(v) for s in series for _, v in s["values"]]
        if not any(math.isfinite(v) for v in values):
            empty.append(f"{title}: {expr} -> {len(series)} series, no finite value")
    assert not empty, ("panel queries without data during the run:\n" + "\n".join(empty)
                       + _history(prometheus, f'ray_dflash_num_drafts_total{{model="{model}"}}', start))


def _history(url: str, selector: str, start: float) -> str:
    """What Prometheus stored of a series and of its scrapes since start: each series' values where they
    changed (seconds since start) and the failed scrapes, for a failure message."""
    window = f"[{int(time.time() - start) + 10}s]"
    lines = [f"\nsamples of {selector} since the run's start:"]
    for series in promql(url, selector + window):
        changes = [(t, v) for i, (t, v) in enumerate(series["values"]) if i == 0 or v != series["values"][i - 1][1]]
        lines.append(f"  {series['metric']}: {[(round(t - start), v) for t, v in changes]}"
                     f" ({len(series['values'])} samples, last at {series['values'][-1][0] - start:.0f} s)")
    for series in promql(url, "up" + window):
        failed = [round(t - start) for t, v in series["values"] if v == "0"]
        lines.append(f"  up{series['metric']}: {len(series['values'])} scrapes, failed at {failed}")
    return "\n".join(lines)


def test_plot_of_a_panel_from_prometheus(prometheus, load_run, tmp_path):
    """`dflash-serve plot-panel` draws panels' series from Prometheus, both topologies in one figure.
    DFLASH_METRICS_PLOT_DIR=docs/metrics keeps the figures (the README's come from this run)."""
    from deployments.dashboards import plot_panel

    runs, start = load_run
    folder = Path(os.environ.get("DFLASH_METRICS_PLOT_DIR", tmp_path))
    variables = {"model": "metrics-.*", "application": "metrics-.*", "__rate_interval": "1m"}
    for title, name in (("Mean acceptance length", "acceptance_length"), ("Output tokens/s", "output_tokens")):
        out = folder / f"{name}.png"
        assert plot_panel(prometheus, title, out, variables, start - 10, time.time(), step_s=2) >= len(TOPOLOGIES)
        assert out.stat().st_size > 10_000
