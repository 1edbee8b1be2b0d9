"""The time a Ray Serve replica spends between engine steps (streaming each step's tokens), as the adaptive
policy measures it (`step_overhead_ms` in the replica's stats): the load test's adaptive app on a loopback
cluster of its own, Locust agent users at 4 and then 16 users, the replica's figure read after each run.

    .venv/bin/python scripts/step_overhead.py --out /tmp/step-overhead
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deployments import bench_serve  # noqa: E402
from deployments.config import AppConfig  # noqa: E402
from loadtest import run as loadtest, scenarios  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="step-overhead", help="folder for the traffic and Locust's files")
    args = ap.parse_args()
    cfg = loadtest.LoadTestConfig(scenarios=["agent"], users=[4, 16], variants=["adaptive"], run_time=90,
                                  requests_per_user=3, min_requests=16, out=args.out)
    out = Path(cfg.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    scenarios.build(out / "scenarios.json", seed=cfg.seed)
    from ray import serve

    url = bench_serve.start_cluster(1)
    try:
        apps = {f"loadtest-{k}": (f"/loadtest-{k}", AppConfig(**c)) for k, c in loadtest.apps(cfg).items()}
        app_url = bench_serve.deploy_apps(apps, url)["loadtest-adaptive"]
        replica = serve.get_deployment_handle("EngineReplica", "loadtest-adaptive")
        for users in cfg.users:
            cell = loadtest.run_cell(cfg, "agent", users, "adaptive", app_url, out / "runs", out / "scenarios.json")
            stats = replica.stats.remote().result()
            print(f"agent, {users} users: {cell['output_tokens_per_s']:.1f} tok/s, rows by block {cell['block_sizes']}, "
                  f"step overhead {stats.get('step_overhead_ms')} ms", flush=True)
    finally:
        import ray

        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
