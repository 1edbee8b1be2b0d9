"""`dflash-serve dashboards`: the Grafana dashboard of the server's metrics, built with Grafana's
foundation SDK (grafana-foundation-sdk); written as JSON files (also into Ray's Grafana provisioning
folder when a Ray session has one) and pushed to a Grafana server with grafana-client.
`dflash-serve plot-panel`: one of its panels drawn from Prometheus as a PNG (what Grafana would show).

It owns the panels and their PromQL. The metric names are deployments/metrics.py's as Ray exports
them (`ray_` prefix, `_total` on counters); this module never imports ray.
"""

import argparse
import json
import os
import re
import time
from pathlib import Path

UID = "dflash-serve"
FILE_NAME = "dflash_serve_grafana_dashboard.json"  # Ray's own dashboards are named *_grafana_dashboard.json
M = "ray_dflash_"  # deployments.metrics.PREFIX as scraped from Ray's metrics agent
OURS = 'model=~"$model", application=~"$application"'  # the selector of our metrics
SERVE = 'application=~"$application"'  # the selector of Ray Serve's own metrics
WINDOW = "[$__rate_interval]"
RAY_SESSION_DIR = Path("/tmp/ray/session_latest")


def rate(metric: str, by: str = "", selector: str = OURS) -> str:
    return f"sum{f' by ({by})' if by else ''} (rate({metric}{{{selector}}}{WINDOW}))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    return f"histogram_quantile({q}, {rate(M + histogram + '_bucket', ', '.join(filter(None, ['le', by])))})"


def mean(histogram: str, by: str = "") -> str:
    return f"{rate(M + histogram + '_sum', by)} / {rate(M + histogram + '_count', by)}"


DRAFTS = rate(M + "num_drafts_total", "model")
# Ray exports a counter only once it was incremented: with nothing accepted yet, count 0 per model
ACCEPTED = f"({rate(M + 'num_accepted_tokens_total', 'model')} or 0 * {DRAFTS})"

PROMPT = rate(M + "num_prompt_tokens_total", "model")

# (title, unit, description, [(PromQL, legend)]); unit is a Grafana unit id
PANELS = [
    ("Mean acceptance length", "none",
     "Tokens committed per verified draft: 1 + accepted / drafts (vLLM's definition); p50 and p90.",
     [(f"1 + {ACCEPTED} / {DRAFTS}", "{{model}} mean"),
      (quantile(0.5, "acceptance_length", "model"), "{{model}} p50"),
      (quantile(0.9, "acceptance_length", "model"), "{{model}} p90")]),
    ("Acceptance rate", "percentunit",
     "Accepted / drafted tokens.",
     [(f"{ACCEPTED} / {rate(M + 'num_draft_tokens_total', 'model')}", "{{model}}")]),
    ("Acceptance by position", "percentunit",
     "Accepted at block position i / drafts (position 0 is the first drafted token).",
     [(f"{rate(M + 'num_accepted_tokens_per_pos_total', 'model, position')}"
       f" / ignoring(position) group_left {DRAFTS}", "{{model}} pos {{position}}")]),
    ("Accepted tokens by proposer", "short",
     "Drafted tokens the target accepted per second, by draft source: dflash (the drafter's block) or suffix "
     "(what the request's context and recent outputs already said); and the acceptance length of each.",
     [(rate(M + "num_accepted_tokens_total", "model, proposer"), "{{model}} {{proposer}} accepted/s"),
      (f"1 + {rate(M + 'num_accepted_tokens_total', 'model, proposer')} / "
       f"{rate(M + 'num_drafts_total', 'model, proposer')}", "{{model}} {{proposer}} mean acceptance length")]),
    ("Output tokens/s", "short",
     "Tokens generated for clients per second, all replicas.",
     [(rate(M + "num_generated_tokens_total", "model"), "{{model}}")]),
    ("Prompt tokens/s", "short",
     "Prompt tokens of requests that got their first token per second, and those of them taken from another "
     "request's KV cache instead of prefilled (prefix caching: the next turn of a conversation, a shared system "
     "prompt).",
     [(PROMPT, "{{model}} prompt"), (f"({rate(M + 'num_cached_prompt_tokens_total', 'model')} or 0 * {PROMPT})",
                                     "{{model}} from the prefix cache")]),
    ("Time to first token", "s", "Percentiles over the window.",
     [(quantile(q, "ttft_seconds"), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]),
    ("Inter-token latency", "s", "Time between consecutive chunks of committed tokens (one per step).",
     [(quantile(q, "itl_seconds"), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]),
    ("End-to-end latency", "s", "Percentiles over the window.",
     [(quantile(q, "e2e_latency_seconds"), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]),
    ("Requests/s by finish reason", "reqps", "stop, length, or abort (an error, a timeout or the client left).",
     [(rate(M + "num_requests_total", "finish_reason"), "{{finish_reason}}")]),
    ("Block size", "none", "Block size chosen per request and step (1 = no speculation).",
     [(mean("block_size"), "mean"), (quantile(0.9, "block_size"), "p90")]),
    ("Batch size per forward", "none", "Requests in one drafter or verify pass.",
     [(mean("batch_size", "forward"), "{{forward}} mean")]),
    ("Draft and verify latency", "s", "One batched pass; p50 and p90.",
     [(quantile(q, f"{name}_latency_seconds"), f"{name} p{round(q * 100)}")
      for name in ("draft", "verify") for q in (0.5, 0.9)]),
    ("Active requests and KV slots", "short", "Per deployment: requests holding state, KV-cache slots used.",
     [(f"sum by (deployment) ({M}active_requests{{{OURS}}})", "{{deployment}} active"),
      (f"sum by (deployment) ({M}used_kv_slots{{{OURS}}})", "{{deployment}} KV slots")]),
    ("Replicas", "short", "Healthy replicas per deployment (Ray Serve).",
     [(f"sum by (deployment) (ray_serve_deployment_replica_healthy{{{SERVE}}})", "{{deployment}}")]),
    ("Queue lengths", "short", "Requests queued for a replica and being processed, per deployment (Ray Serve).",
     [(f"sum by (deployment) (ray_serve_deployment_queued_queries{{{SERVE}}})", "{{deployment}} queued"),
      (f"sum by (deployment) (ray_serve_replica_processing_queries{{{SERVE}}})", "{{deployment}} processing")]),
]


def build_dashboard() -> dict:
    """The dashboard as Grafana's JSON model (a dict), built with the foundation SDK."""
    from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

    source = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (
        dashboard.Dashboard("dflash-serve: speculative decoding").uid(UID).tags(["dflash", "ray-serve"])
        .description("DFlash speculative decoding on Ray Serve: acceptance, throughput, latency, load.")
        .time("now-30m", "now").refresh("10s")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    for name, metric in (("application", "ray_serve_deployment_replica_healthy"),
                         ("model", M + "e2e_latency_seconds_count")):
        board = board.with_variable(
            dashboard.QueryVariable(name).datasource(source).query(f"label_values({metric}, {name})")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).include_all(True).all_value(".*").multi(True))
    for panel_id, (title, unit, description, queries) in enumerate(PANELS, 1):
        panel = timeseries.Panel().id(panel_id).title(title).description(description).unit(unit).datasource(source)
        for ref_id, (expr, legend) in zip("ABCDEFGH", queries):
            panel = panel.with_target(
                prometheus.Dataquery().ref_id(ref_id).datasource(source).expr(expr).legend_format(legend))
        board = board.with_panel(panel.span(8).height(8))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def panel_queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel."""
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


def ray_dashboards_dir() -> Path | None:
    """The folder Ray's Grafana provisioning reads dashboards from, if a Ray session set one up."""
    if os.environ.get("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR"):
        return Path(os.environ["RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR"])
    grafana = RAY_SESSION_DIR / "metrics" / "grafana"
    return grafana / "dashboards" if grafana.is_dir() else None


def write(board: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FILE_NAME
    path.write_text(json.dumps(board, indent=2) + "\n")
    return path


class PushError(Exception):
    """The dashboard could not be pushed; the message says why and to whom."""


def push(board: dict, url: str, token: str, timeout_s: float = 10) -> str:
    """Create or replace the dashboard on the Grafana server at `url` (POST /api/dashboards/db with a
    bearer token); returns the dashboard's URL on that server."""
    import niquests
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaUnauthorizedError

    grafana = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    try:
        result = grafana.dashboard.update_dashboard({"dashboard": board, "overwrite": True,
                                                     "message": "dflash-serve dashboards"})
    except GrafanaUnauthorizedError:
        raise PushError(f"Grafana at {url} rejected the token (401 Unauthorized): pass a service-account "
                        "token with the Editor role as --grafana-token") from None
    except GrafanaClientError as e:
        raise PushError(f"Grafana at {url} refused the dashboard: {e}") from None
    except (GrafanaException, niquests.exceptions.RequestException) as e:
        raise PushError(f"cannot reach Grafana at {url}: {e}") from None
    return url.rstrip("/") + result.get("url", f"/d/{UID}")


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--out", default="dashboards", help="folder to write the dashboard JSON into")
    parser.add_argument("--no-ray", action="store_true",
                        help="do not also write into the Ray session's Grafana provisioning folder")
    parser.add_argument("--grafana-url", default=None, help="push to this Grafana server (e.g. http://127.0.0.1:3000)")
    parser.add_argument("--grafana-token", default=os.environ.get("GRAFANA_TOKEN"),
                        help="Grafana service-account token (default: $GRAFANA_TOKEN)")


def run(args):
    """Write the dashboard (and push it); a failed push raises PushError."""
    if args.grafana_url and not args.grafana_token:
        raise PushError("--grafana-url needs --grafana-token (or $GRAFANA_TOKEN)")
    board = build_dashboard()
    folders = [Path(args.out)]
    ray_dir = None if args.no_ray else ray_dashboards_dir()
    if ray_dir is not None:
        folders.append(ray_dir)
    for folder in folders:
        print(f"wrote {write(board, folder)}")
    if args.grafana_url:
        print(f"pushed {push(board, args.grafana_url, args.grafana_token)}")


# ---- a panel drawn from Prometheus ----------------------------------------------------------------


def fill(expr: str, variables: dict[str, str]) -> str:
    """A panel query with Grafana's variables ($model, $application, $__rate_interval) replaced."""
    return re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), expr)


def query_range(prometheus: str, expr: str, start: float, end: float, step_s: float) -> list[dict]:
    import httpx

    r = httpx.get(f"{prometheus}/api/v1/query_range",
                  params={"query": expr, "start": start, "end": end, "step": step_s}, timeout=30)
    r.raise_for_status()
    return r.json()["data"]["result"]


def legend(template: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def plot_panel(prometheus: str, title: str, out: Path, variables: dict[str, str], start: float, end: float,
               step_s: float = 5) -> int:
    """Draw the panel `title`, every query of it range-queried from `start` to `end`, into `out`; returns
    the number of series drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panel = next((p for p in build_dashboard()["panels"] if p["title"] == title), None)
    if panel is None:
        raise ValueError(f"no panel titled {title!r} in the dashboard")
    fig = Figure(figsize=(8, 3.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    num_series = 0
    for target in panel["targets"]:
        for series in query_range(prometheus, fill(target["expr"], variables), start, end, step_s):
            points = [(float(t) - start, float(v)) for t, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]
            if points:
                ax.plot(*zip(*points), marker=".", label=legend(target.get("legendFormat", ""), series["metric"]))
                num_series += 1
    ax.set_title(f"{title} (Prometheus, {variables.get('__rate_interval', '')} rate window)")
    ax.set_xlabel("seconds since the start of the run")
    ax.set_ylabel(panel["fieldConfig"]["defaults"].get("unit", ""))
    ax.grid(alpha=0.3)
    if num_series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return num_series


def add_plot_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--panel", default="Mean acceptance length", help="the panel's title in the dashboard")
    parser.add_argument("--out", required=True, metavar="PATH.png")
    parser.add_argument("--minutes", type=float, default=10, help="plot the last N minutes")
    parser.add_argument("--model", default=".*", help="regex for the model label")
    parser.add_argument("--application", default=".*", help="regex for the Serve application label")
    parser.add_argument("--rate-window", default="1m", help="what $__rate_interval stands for")


def plot(args):
    end = time.time()
    variables = {"model": args.model, "application": args.application, "__rate_interval": args.rate_window}
    n = plot_panel(args.prometheus, args.panel, Path(args.out), variables, end - 60 * args.minutes, end)
    print(f"wrote {args.out} ({n} series)")
