"""`dflash-serve serve`: start a local Ray cluster on loopback, run the Serve application on
127.0.0.1 and block until interrupted. It owns only the process's lifetime; the app is build_app's.
"""

import math
import os
import time

def app_config(args):
    """The AppConfig of the `serve` flags (and DFLASH_API_KEYS); unset flags keep AppConfig's defaults."""
    from deployments.config import AppConfig, env_api_keys

    optional = {"max_queued_requests": args.max_queued_requests, "request_timeout_s": args.request_timeout_s}
    keys = [*args.api_key, *env_api_keys()]  # the replicas would read the environment too; this shows the count
    config = AppConfig(
        target=args.target, draft=args.draft, dtype=args.dtype, device=args.device, policy=args.policy,
        block_size=args.block_size, max_slots=args.max_slots, num_replicas=args.num_replicas, api_keys=keys,
        topology=args.topology, num_shards=args.num_shards, shard_placement=args.shard_placement,
        **{k: v for k, v in optional.items() if v is not None},
    )
    if config.num_shards > 1:
        from deployments.shards import check_num_shards

        check_num_shards(config)  # more shards than the target has layers: an error before Ray starts
    return config


def reserved_cpus(config) -> float:
    """Ray CPUs the application reserves: per engine (or verifier) replica its own and its shards',
    and the drafter replicas' when disaggregated (the ingress and the router reserve none)."""
    shards = config.num_shards * config.shard_num_cpus if config.num_shards > 1 else 0
    drafters = config.drafter_num_cpus * config.drafter_num_replicas if config.topology == "disaggregated" else 0
    return config.num_replicas * (config.num_cpus + shards) + drafters


def serve_forever(config, port: int):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # else Ray 2.60 binds the external address
    import ray
    from ray import serve

    from deployments.app import build_app

    # the dashboard (Serve tab) on loopback; it also writes the discovery file cluster/prometheus.yml reads
    # logical CPUs: what the app reserves (more than the machine has is allowed; they then share its cores)
    context = ray.init(address="local", num_cpus=max(2, math.ceil(reserved_cpus(config))), include_dashboard=True,
                       dashboard_host="127.0.0.1", _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name="dflash", route_prefix="/")
        auth = f", {len(config.api_keys)} API key(s) required" if config.api_keys else ""
        print(f"dflash-serve: serving {config.model_name} at http://127.0.0.1:{port}/v1{auth} (Ctrl-C stops); "
              f"Ray dashboard at http://{context.dashboard_url}", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
