"""`dflash-serve serve`: start a local Ray cluster on loopback, run the Serve application on
127.0.0.1 and block until interrupted. It owns only the process's lifetime; the app is build_app's.
"""

import os
import time


def serve_forever(args):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # else Ray 2.60 binds the external address
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.config import AppConfig

    config = AppConfig(
        target=args.target, draft=args.draft, dtype=args.dtype, device=args.device, policy=args.policy,
        block_size=args.block_size, max_slots=args.max_slots, num_replicas=args.num_replicas,
    )
    ray.init(address="local", num_cpus=max(2, args.num_replicas), include_dashboard=False,
             _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(config), name="dflash", route_prefix="/")
        print(f"dflash-serve: serving {config.model_name} at http://127.0.0.1:{args.port}/v1 (Ctrl-C stops)",
              flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
