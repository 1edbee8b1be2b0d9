"""`dflash-serve train-curves`: held-out tau against training CPU time for several drafter runs, side by side.

    dflash-serve train-curves --out runs/data-size \
        "768 prompts=docs/train/main-768/evals.json" "3,072 prompts=docs/train/main/evals.json"

Each run is LABEL=PATH, PATH being a run's log.jsonl or an evals.json (its held-out evaluations);
LABEL=PATH1+PATH2 chains a run and one started from its drafter (`train --init`): the second run's
CPU time counts on from the first's end, and its evaluation at step 0 (the same drafter) is dropped.
Writes curves.md (tau at common CPU-minutes, best tau and where, and (tau - 1) relative to the first
run) and curves.png. It reads training logs only; it knows nothing about models.
"""

import json
import math
from pathlib import Path


def load_evals(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [e for e in entries if e.get("eval")]
    return json.loads(path.read_text())


def chain(parts: list[list[dict]]) -> list[dict]:
    evals = list(parts[0])
    for part in parts[1:]:
        offset = evals[-1]["cpu_seconds"]
        evals += [{**e, "cpu_seconds": e["cpu_seconds"] + offset} for e in part if e["step"] > 0]
    return evals


def tau_at(evals: list[dict], cpu_minutes: float) -> float | None:
    """The last evaluation at or before that much CPU time (None if the run stopped before it)."""
    if evals[-1]["cpu_seconds"] < cpu_minutes * 60 * 0.97:
        return None
    before = [e for e in evals if e["cpu_seconds"] <= cpu_minutes * 60 * 1.03]
    return before[-1]["tau"] if before else None


def power_fit(evals: list[dict], from_minutes: float) -> tuple[float, float]:
    """Least squares of log(tau - 1) = a + k log(CPU-minutes) over the evaluations from `from_minutes` on:
    returns (a, k). A straight line on log-log axes; an extrapolation, not a law."""
    pts = [(math.log(e["cpu_seconds"] / 60), math.log(e["tau"] - 1)) for e in evals
           if e["cpu_seconds"] >= from_minutes * 60 and e["tau"] > 1]
    if len(pts) < 3:
        raise ValueError(f"fewer than 3 evaluations after {from_minutes:g} CPU-minutes to fit")
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    k = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return my - k * mx, k


def projection(evals: list[dict], from_minutes: float, targets: list[float]) -> list[str]:
    a, k = power_fit(evals, from_minutes)
    lines = [f"Fit over the evaluations from {from_minutes:g} CPU-minutes on: tau - 1 = {math.exp(a):.3g} x "
             f"CPU-minutes^{k:.2f}."]
    for t in targets:
        if k <= 0:
            lines.append(f"tau {t:g}: not reached (the fit does not rise)")
        else:
            lines.append(f"tau {t:g}: at ~{math.exp((math.log(t - 1) - a) / k) / 60:.0f} CPU-hours")
    return lines


def write_table(runs: dict[str, list[dict]], points: list[float], path: Path, extra: list[str] = ()):
    first = next(iter(runs))
    lines = ["Held-out greedy tau (block 16) after N process CPU-minutes of training "
             "(the last evaluation at or before N).", "",
             "| run | " + " | ".join(f"{p:g}" for p in points) + " | best tau (at CPU-min) |",
             "|---|" + "---|" * (len(points) + 1)]
    for label, evals in runs.items():
        cells = []
        for p in points:
            t, t0 = tau_at(evals, p), tau_at(runs[first], p)
            rel = f" ({(t - 1) / (t0 - 1):.2f}x)" if t and t0 and t0 > 1 and label != first else ""
            cells.append("-" if t is None else f"{t:.3f}{rel}")
        best = max(evals, key=lambda e: e["tau"])
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {best['tau']:.3f} ({best['cpu_seconds'] / 60:.0f}) |")
    lines += ["", f"(In brackets: accepted drafts per step, tau - 1, relative to `{first}` at the same CPU time.)"]
    if extra:
        lines += ["", *extra]
    path.write_text("\n".join(lines) + "\n")


def plot(runs: dict[str, list[dict]], path: Path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, evals in runs.items():
        ax.plot([e["cpu_seconds"] / 60 for e in evals], [e["tau"] for e in evals], marker="o", markersize=3, label=label)
    ax.set(xlabel="process CPU-minutes of training", ylabel="held-out tau (greedy, block 16)", title="drafter training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def read_runs(specs: list[str]) -> dict[str, list[dict]]:
    """{label: evaluations} of LABEL=PATH[+PATH] specs; ValueError naming the bad one."""
    runs = {}
    for spec in specs:
        label, sep, paths = spec.partition("=")
        parts = []
        for path in paths.split("+"):
            if not sep or not Path(path).is_file():
                raise ValueError(f"run {spec!r}: expected LABEL=PATH[+PATH] to log.jsonl or evals.json files that exist")
            parts.append(load_evals(Path(path)))
            if not parts[-1]:
                raise ValueError(f"run {spec!r}: no held-out evaluations in {path}")
        runs[label] = chain(parts)
    return runs


def run(runs: dict[str, list[dict]], out: Path, points: list[float], project: list[float] = (),
        fit_from: float = 20.0) -> str:
    """Write curves.md and curves.png into `out`; returns the table. With `project`, the last run's curve is
    fitted (tau - 1 as a power of CPU time) and the CPU time each of those taus would take is added."""
    out.mkdir(parents=True, exist_ok=True)
    extra = []
    if project:
        label = list(runs)[-1]
        extra = [f"Projection for `{label}` (a power law through its curve):", "",
                 *projection(runs[label], fit_from, list(project))]
    write_table(runs, points, out / "curves.md", extra)
    plot(runs, out / "curves.png")
    return (out / "curves.md").read_text()
