"""`dflash-serve serve`: start a local Ray cluster on loopback, run the Serve application on
127.0.0.1 and block until interrupted (Ctrl-C or SIGTERM), then stop every process it started.
It owns only the process's lifetime; the app is build_app's.
"""

import faulthandler
import math
import os
import signal
import sys
import threading
import time

import psutil

STOP_TIMEOUT_S = 3  # how long Ray's processes get to exit after ray.shutdown() before they are killed
SHUTDOWN_TIMEOUT_S = 5  # how long ray.shutdown() may take before the processes are stopped without it
WATCH_EVERY_S = 2  # how often the processes this one started are noted (replicas start and stop while it serves)


def reserved_cpus(config) -> float:
    """Ray CPUs the application reserves: per engine (or verifier) replica its own and its shards',
    and the drafter replicas' when disaggregated (the ingress and the router reserve none)."""
    shards = config.num_shards * config.shard_num_cpus if config.num_shards > 1 else 0
    drafters = config.drafter_num_cpus * config.drafter_num_replicas if config.topology == "disaggregated" else 0
    return config.num_replicas * (config.num_cpus + shards) + drafters


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops the server the way Ctrl-C does


def _stop_on_interrupts():
    """SIGINT and SIGTERM raise KeyboardInterrupt, whatever the parent handed down: a process started in the
    background of a script inherits SIGINT ignored (Python then installs no handler of its own), and a
    parent can hand signals down blocked."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


def stop(processes: set[psutil.Process], timeout_s: float = STOP_TIMEOUT_S):
    """Terminate what is left of `processes`, then kill what still runs after `timeout_s`. Ray's agents
    (DashboardAgent, RuntimeEnvAgent) can outlive their raylet, which no longer reaps them."""
    alive = [p for p in processes if p.is_running()]
    for p in alive:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout_s)


def serve_forever(config, port: int):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # else Ray 2.60 binds the external address
    import ray
    from ray import serve

    from deployments.app import build_app

    _stop_on_interrupts()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: every thread's stack to stderr (a server that hangs)
    me, started = psutil.Process(), set()
    try:
        # the dashboard (Serve tab) on loopback; it also writes the discovery file cluster/prometheus.yml reads
        # logical CPUs: what the app reserves (more than the machine has is allowed; they then share its cores)
        context = ray.init(address="local", num_cpus=max(2, math.ceil(reserved_cpus(config))), include_dashboard=True,
                           dashboard_host="127.0.0.1", _node_ip_address="127.0.0.1")
        _stop_on_interrupts()  # again: ray.init put its own SIGTERM handler (it logs, then aborts at exit)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name="dflash", route_prefix="/")
        auth = f", {len(config.api_keys)} API key(s) required" if config.api_keys else ""
        print(f"dflash-serve: serving {config.model_name} at http://127.0.0.1:{port}/v1{auth} (Ctrl-C stops); "
              f"Ray dashboard at http://{context.dashboard_url} (its token: .venv/bin/ray get-auth-token)", flush=True)
        while True:
            started.update(me.children(recursive=True))
            time.sleep(WATCH_EVERY_S)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("dflash-serve: stopping", flush=True)
        started.update(me.children(recursive=True))
        stopping = time.monotonic()
        # the app ends with the cluster (serve.shutdown() would drain every replica first: too slow); a
        # shutdown that hangs (a Ctrl-C also reaches Ray's processes) must not keep the others running
        shutting_down = threading.Thread(target=ray.shutdown, daemon=True)
        shutting_down.start()
        shutting_down.join(SHUTDOWN_TIMEOUT_S)
        stop(started)
        print(f"dflash-serve: stopped {len(started)} processes in {time.monotonic() - stopping:.1f} s", flush=True)
        if shutting_down.is_alive():  # Ray's exit handlers would wait on it again
            print(f"dflash-serve: ray.shutdown() took over {SHUTDOWN_TIMEOUT_S} s; its processes were stopped",
                  file=sys.stderr, flush=True)
            os._exit(0)
