"""The training-efficiency study: each recipe trains for the same process CPU time on the same
data, one after another in this process, and is scored by held-out greedy tau (block 16).

    python scripts/train_study.py --data DIR --held-out DIR --cpu-minutes 5 --out docs/train/study

Writes study.md (the table), study.json and study.png (held-out tau vs CPU-minutes per recipe).
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.train import TrainConfig, read_log, train  # noqa: E402

NAIVE = dict(num_layers=3, vocab_subset=0, feature_norm=False, init="random", distill=0.0, anchors=32, lr=6e-4)
BASE = dict(NAIVE, num_layers=1, vocab_subset=8192, feature_norm=True)
RECIPES = {  # name: (what changes, settings)
    "naive": ("the issue's first attempt: 3 layers, full head, raw features", NAIVE),
    "1-layer": ("naive with 1 draft layer", dict(NAIVE, num_layers=1)),
    "1-layer+vocab8k": ("1 layer, loss over the 8,192 most frequent tokens", dict(NAIVE, num_layers=1, vocab_subset=8192)),
    "base": ("1 layer, vocab 8k, features normalised per channel", BASE),
    "base+init": ("base, draft layer initialised from the target's last layer", dict(BASE, init="target")),
    "base+distill": ("base, loss half distillation from the target's top-8", dict(BASE, distill=0.5)),
    "base+anchors64": ("base, 64 blocks per sequence", dict(BASE, anchors=64)),
    "base+lr2e-3": ("base, peak lr 2e-3", dict(BASE, lr=2e-3)),
    "base+2-layers": ("base, 2 draft layers", dict(BASE, num_layers=2)),
    "2-layers+vocab8k": ("the shipped recipe with 2 draft layers", dict(NAIVE, num_layers=2, vocab_subset=8192)),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--held-out", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cpu-minutes", type=float, default=5.0)
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma list of " + ", ".join(RECIPES))
    p.add_argument("--eval-every", type=int, default=100)
    args = p.parse_args()
    names = [n for n in args.recipes.split(",") if n]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        p.error(f"--recipes: unknown {', '.join(unknown)}; choose from {', '.join(RECIPES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = json.loads((out / "study.json").read_text()) if (out / "study.json").exists() else {}
    for name in names:
        run_dir = out / "runs" / name
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        cfg = TrainConfig(data=args.data, held_out=args.held_out, out=str(run_dir), cpu_minutes=args.cpu_minutes,
                          eval_every=args.eval_every, save_every=10**9, steps=10**9, **RECIPES[name][1])
        print(f"== {name}: {RECIPES[name][0]}", flush=True)
        final = train(cfg)
        steps, evals = read_log(run_dir / "log.jsonl")
        results[name] = {
            "what": RECIPES[name][0], "settings": RECIPES[name][1], "steps": final["step"],
            "cpu_seconds": final["cpu_seconds"], "blocks_per_cpu_second": final["blocks"] / final["cpu_seconds"],
            "tau": final["tau"], "tau_ci": final.get("tau_ci"), "acceptance_per_pos": final["acceptance_per_pos"],
            "curve": [(e["cpu_seconds"], e["tau"]) for e in evals],
        }
        (out / "study.json").write_text(json.dumps(results, indent=1) + "\n")
        shutil.rmtree(run_dir / "drafter", ignore_errors=True)
        (run_dir / "checkpoint.pt").unlink(missing_ok=True)
    write_table(results, out / "study.md", args.cpu_minutes)
    plot(results, out / "study.png")
    print((out / "study.md").read_text())


def write_table(results, path, cpu_minutes):
    naive = results.get("naive", {}).get("tau")
    lines = [f"Held-out greedy tau (block 16) after {cpu_minutes:g} CPU-minutes of training each, same data.", "",
             "| recipe | what | steps | blocks / CPU-s | tau | tau vs naive | acceptance pos 1 / 2 / 4 |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        acc = r["acceptance_per_pos"]
        vs = f"{(r['tau'] - 1) / (naive - 1):.2f}x" if naive and naive > 1 else "-"
        ci = f" ({r['tau_ci'][0]:.2f}-{r['tau_ci'][1]:.2f})" if r.get("tau_ci") else ""
        lines.append(f"| {name} | {r['what']} | {r['steps']} | {r['blocks_per_cpu_second']:.0f} | {r['tau']:.3f}{ci} | {vs} | "
                     f"{acc[0]:.2f} / {acc[1]:.2f} / {acc[3]:.2f} |")
    lines.append("")
    lines.append("(tau vs naive compares the accepted drafts per step, tau - 1; in brackets, where logged, a 95% "
                 "bootstrap interval over held-out replies.)")
    Path(path).write_text("\n".join(lines) + "\n")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        xs, ys = zip(*r["curve"])
        ax.plot([x / 60 for x in xs], ys, marker="o", label=name)
    ax.set(xlabel="process CPU-minutes", ylabel="held-out tau (greedy, block 16)", title="training efficiency")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
