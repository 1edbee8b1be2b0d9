"""Plot one panel of the dflash-serve Grafana dashboard from Prometheus as a PNG (what Grafana would
draw): every query of the panel, range-queried over the last minutes, with the dashboard's variables
filled in. Used for docs/metrics/ after a load run:

    .venv/bin/python scripts/plot_prometheus.py --prometheus http://127.0.0.1:9090 \
        --panel "Mean acceptance length" --out docs/metrics/acceptance_length.png
"""

import argparse
import re
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deployments.dashboards import build_dashboard  # noqa: E402


def fill(expr: str, variables: dict[str, str]) -> str:
    """A panel query with Grafana's variables ($model, $application, $__rate_interval) replaced."""
    return re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), expr)


def query_range(prometheus: str, expr: str, start: float, end: float, step_s: float) -> list[dict]:
    r = httpx.get(f"{prometheus}/api/v1/query_range",
                  params={"query": expr, "start": start, "end": end, "step": step_s}, timeout=30)
    r.raise_for_status()
    return r.json()["data"]["result"]


def legend(template: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def plot_panel(prometheus: str, title: str, out: Path, variables: dict[str, str], start: float, end: float,
               step_s: float = 5) -> int:
    """Draw the panel `title` into `out`; returns the number of series drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panel = next((p for p in build_dashboard()["panels"] if p["title"] == title), None)
    if panel is None:
        raise ValueError(f"no panel titled {title!r} in the dashboard")
    fig, ax = plt.subplots(figsize=(8, 3.6))
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
    plt.close(fig)
    return num_series


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prometheus", default="http://127.0.0.1:9090")
    p.add_argument("--panel", default="Mean acceptance length", help="the panel's title in the dashboard")
    p.add_argument("--out", required=True, metavar="PATH.png")
    p.add_argument("--minutes", type=float, default=10, help="plot the last N minutes")
    p.add_argument("--model", default=".*", help="regex for the model label")
    p.add_argument("--application", default=".*", help="regex for the Serve application label")
    p.add_argument("--rate-window", default="1m", help="what $__rate_interval stands for")
    args = p.parse_args()
    end = time.time()
    variables = {"model": args.model, "application": args.application, "__rate_interval": args.rate_window}
    n = plot_panel(args.prometheus, args.panel, Path(args.out), variables, end - 60 * args.minutes, end)
    print(f"wrote {args.out} ({n} series)")


if __name__ == "__main__":
    main()
