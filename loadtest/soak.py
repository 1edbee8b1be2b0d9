"""`dflash-serve soak`: mixed chat + RAG + agent traffic for a bounded time against a server it deploys,
watching what must stay flat: the resident memory of the app's replica processes (ingress, engine)
and the used KV slots (they must return to 0 once the load stops).

Locust runs as its own process (all three user classes, equal weights, the traffic of
loadtest/scenarios.py); meanwhile this process samples every --sample-every seconds: each replica
process's RSS (psutil; the cluster is on this machine), and the engine's slots and the tokens its
suffix index holds from /health. Memory growth = median of the last fifth of the
samples minus the median of the second fifth (the first fifth is warm-up: allocator pools, caches).
"""

import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from deployments.config import AppConfig
from engine.config import EngineConfig
from loadtest.run import ROOT, USERS, LoadTestConfig, locust_command

APP = "soak"


@dataclass
class SoakConfig:
    minutes: float = 10.0
    users: int = 12  # more than the default 8 slots: requests also queue
    max_tokens: int = 64
    sample_every: float = 10.0
    policy: str = EngineConfig.policy  # the server's: `dflash-serve serve` with no flags
    max_slots: int = EngineConfig.max_slots
    suffix_index_tokens: int = EngineConfig.suffix_index_tokens  # set small, a run fills it and shows the bound hold
    num_cpus: float = 1.0
    out: str = "soak-report"
    seed: int = 0


def app_config(cfg: SoakConfig) -> AppConfig:
    return AppConfig(policy=cfg.policy, max_slots=cfg.max_slots, num_cpus=cfg.num_cpus,
                     suffix_index_tokens=cfg.suffix_index_tokens)


def check_config(cfg: SoakConfig) -> str | None:
    if cfg.minutes <= 0:
        return f"--minutes must be > 0, got {cfg.minutes}"
    if cfg.users < 1:
        return f"--users must be >= 1, got {cfg.users}"
    if cfg.sample_every <= 0:
        return f"--sample-every must be > 0 seconds, got {cfg.sample_every}"
    if cfg.max_tokens < 1:
        return f"--max-tokens must be >= 1, got {cfg.max_tokens}"
    if not Path(cfg.out).resolve().parent.is_dir():
        return f"--out {cfg.out}: the folder {Path(cfg.out).resolve().parent} does not exist"
    try:
        app_config(cfg)
    except ValueError as e:
        return " ".join(str(e).split())
    return None


def sample(url: str) -> dict:
    """Now: {"t", "rss_mb": {deployment: MB}, "slots": /health's engine figures}. Replica processes
    are found by the title Ray gives them (ray::ServeReplica:<app>:<deployment>) on this machine."""
    import httpx
    import psutil

    rss = {}
    for p in psutil.process_iter(["cmdline", "memory_info"]):
        title = " ".join(p.info["cmdline"] or [])
        prefix = f"ray::ServeReplica:{APP}:"
        if title.startswith(prefix) and p.info["memory_info"] is not None:
            name = title.removeprefix(prefix).split(".")[0].split()[0]  # the title shows the method being run
            rss[name] = rss.get(name, 0) + p.info["memory_info"].rss / 2**20
    try:
        slots = httpx.get(f"{url}/health", timeout=10).json().get("engine", {})
    except Exception as e:  # recorded, not fatal: the run's failures say whether the server was down
        slots = {"error": f"{type(e).__name__}: {e}"}
    return {"t": time.time(), "rss_mb": rss, "slots": slots}


def growth(samples: list[dict], name: str) -> dict:
    values = [s["rss_mb"][name] for s in samples if name in s["rss_mb"]]
    fifth = max(1, len(values) // 5)
    base, end = statistics.median(values[fifth: 2 * fifth]), statistics.median(values[-fifth:])
    return {"baseline_mb": base, "end_mb": end, "growth_mb": end - base, "growth_pct": 100 * (end - base) / base,
            "max_mb": max(values)}


def plot(report: dict, path: Path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    samples = report["samples"]
    t0 = samples[0]["t"]
    minutes = [(s["t"] - t0) / 60 for s in samples]
    fig = Figure(figsize=(14, 4))
    FigureCanvasAgg(fig)
    ax_mem, ax_slots, ax_suffix = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
    for name in report["memory"]:
        ax_mem.plot(minutes, [s["rss_mb"].get(name) for s in samples], marker=".", label=name)
    for key in ("used", "waiting"):
        ax_slots.plot(minutes, [s["slots"].get(key) for s in samples], marker=".", label=f"{key} slots"
                      if key == "used" else "waiting requests")
    ax_slots.axvline(report["load_minutes"], color="gray", ls=":", label="load stops")
    ax_suffix.plot(minutes, [s["slots"].get("suffix_index_tokens") for s in samples], marker=".", label="held")
    ax_suffix.axhline(report["config"]["suffix_index_tokens"], color="gray", ls="--", label="bound")
    for ax, label in ((ax_mem, "RSS (MB)"), (ax_slots, "engine replica"), (ax_suffix, "suffix index tokens")):
        ax.set_xlabel("minutes")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"soak: {report['config']['users']} mixed users for {report['config']['minutes']:g} min", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"# Soak: {c['users']} mixed users (chat, RAG, agent) for {c['minutes']:g} minutes", "",
             f"Server: colocated, policy {c['policy']}, {c['max_slots']} slots; max_tokens {c['max_tokens']}; "
             f"samples every {c['sample_every']:g} s.", "",
             "| scenario | requests | failures | output tokens |", "|---|---|---|---|"]
    for s, t in report["traffic"].items():
        lines.append(f"| {s} | {t['requests']} | {t['failures']} | {t['output_tokens']} |")
    lines += ["", "| process | baseline MB (2nd fifth) | end MB (last fifth) | growth MB | growth % | max MB |",
              "|---|---|---|---|---|---|"]
    for name, g in report["memory"].items():
        lines.append(f"| {name} | {g['baseline_mb']:.0f} | {g['end_mb']:.0f} | {g['growth_mb']:+.1f} | "
                     f"{g['growth_pct']:+.2f} | {g['max_mb']:.0f} |")
    lines += ["", f"Used KV slots: at most {report['max_used_slots']} during the load, {report['end_used_slots']} "
              f"after it (of {c['max_slots']}).",
              f"Suffix index: at most {report['max_suffix_tokens']} tokens held (bound {c['suffix_index_tokens']}), "
              f"{report['end_suffix_tokens']} at the end.", ""]
    return "\n".join(lines)


def run(cfg: SoakConfig, cluster_url: str | None = None) -> dict:
    problem = check_config(cfg)
    if problem:
        raise ValueError(problem)
    from tqdm import tqdm

    from deployments import bench_serve
    from loadtest import scenarios

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    scenario_file = out / "scenarios.json"
    scenarios.build(scenario_file, seed=cfg.seed)
    owned = cluster_url is None
    if owned:
        cluster_url = bench_serve.start_cluster(num_cpus=max(1, round(cfg.num_cpus)))
    try:
        app = app_config(cfg)
        url = bench_serve.deploy_apps({APP: (f"/{APP}", app)}, cluster_url)[APP]
        load = LoadTestConfig(run_time=cfg.minutes * 60, max_requests=10**9, max_tokens=cfg.max_tokens, seed=cfg.seed)
        command = locust_command(load, list(USERS), cfg.users, url, out / "locust", None, scenario_file)
        samples, start = [sample(url)], time.time()
        with open(out / "locust.log", "w") as log, tqdm(total=round(cfg.minutes * 60), desc="soak", unit="s") as bar:
            locust = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                      env=dict(os.environ, PYTHONPATH=str(ROOT)))
            while locust.poll() is None:
                time.sleep(cfg.sample_every)
                samples.append(sample(url))
                bar.n = min(bar.total, round(time.time() - start))
                bar.set_postfix_str(f"used slots {samples[-1]['slots'].get('used')}")
        load_minutes = (time.time() - start) / 60
        for _ in range(30):  # the load has stopped: every slot must come back
            samples.append(sample(url))
            if samples[-1]["slots"].get("used") == 0:
                break
            time.sleep(1)
    finally:
        from ray import serve

        if owned:
            import ray

            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(APP)
    summary = json.loads((out / "locust.json").read_text())
    names = sorted({n for s in samples for n in s["rss_mb"]})
    report = {
        "config": asdict(cfg), "load_minutes": load_minutes, "samples": samples,
        "traffic": {s: {k: summary[s][k] for k in ("requests", "failures", "output_tokens")}
                    for s in USERS if s in summary},
        "memory": {n: growth(samples, n) for n in names},
        "max_used_slots": max(s["slots"].get("used") or 0 for s in samples),
        "end_used_slots": samples[-1]["slots"].get("used"),
        "max_suffix_tokens": max(s["slots"].get("suffix_index_tokens") or 0 for s in samples),
        "end_suffix_tokens": samples[-1]["slots"].get("suffix_index_tokens"),
    }
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "soak.md").write_text(markdown(report) + "\n![soak](soak.png)\n")
    plot(report, out / "soak.png")
    print(markdown(report))
    return report
