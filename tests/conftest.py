"""Session-wide fixtures: one local Ray cluster with Serve, on loopback, shared by every server test
(starting Ray costs ~4 s, Serve ~2 s: once per session, never per test)."""

import os
import socket
import time
from pathlib import Path

import pytest

# Ray reads this when it is imported: set it before any test module imports ray, else Ray 2.60
# binds the machine's external address instead of 127.0.0.1.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

ROOT = Path(__file__).resolve().parent.parent
RAY_CPUS = 2
# A chat request that decodes for a long while (greedy, no EOS for hundreds of tokens on every host tried; the
# earlier "Write a haiku about the sea." ends after ~40 tokens, and "Tell me a long story." stopped after 55 on
# an AVX512 host in float32): for tests that must catch a request while it runs
LONG_CHAT = {"messages": [{"role": "user", "content": "List the numbers from 1 to 1000, separated by commas."}],
             "max_tokens": 1500, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_cluster():
    """A fresh local Ray cluster (127.0.0.1 only, RAY_CPUS CPUs) with Serve's HTTP proxy on a free
    loopback port; yields the base URL. Shuts down only what it started."""
    import ray
    from ray import serve

    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": python_path}})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(app, name, cluster_url, route_prefix="/") -> str:
    """serve.run `app` on the session cluster and wait until its /health answers; returns its base URL."""
    import httpx
    from ray import serve

    serve.run(app, name=name, route_prefix=route_prefix)
    base = cluster_url + route_prefix.rstrip("/")
    deadline = time.monotonic() + 120
    while httpx.get(f"{base}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, f"{name} never became healthy"
        time.sleep(0.5)
    return base


def openai_client(base_url):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def exits_naming_the_flag(capsys, argv: list[str], message: str):
    """`dflash-serve ARGV` exits with status 2 before any work, saying `message` on stderr."""
    from dflash_serve import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
