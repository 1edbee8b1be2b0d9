"""Autoscaling on real Ray Serve: sustained concurrent streaming load takes the engine deployment from
one replica to two; when the load stops it goes back to one. Its own application and route prefix
in the session's cluster, deleted at the end; 0.5 CPUs per replica so two fit the 2-CPU cluster
beside another test module's app (torch still gets one thread per replica)."""

import threading
import time

import httpx
import pytest
from ray import serve

from deployments.app import build_app
from deployments.config import AppConfig

APP_NAME = "dflash-autoscaling-test"
ROUTE = "/autoscale"
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 1,
               "downscale_delay_s": 3, "metrics_interval_s": 0.5, "look_back_period_s": 1}
# DFlash drafts only: the load must last (suffix drafts make a looping reply fast)
CONFIG = AppConfig(policy="fixed", draft="random", dtype="float32", max_slots=4, num_cpus=0.5, autoscaling_config=AUTOSCALING,
                   proposers="dflash")
CLIENTS = 4
# metrics_interval_s is deprecated in Ray 2.60 (in favour of environment variables) but still honoured
pytestmark = pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")
LOAD_LIMIT_S = 90  # the load never outlives this, whatever happens to the test
SCALE_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def app_url(serve_cluster):
    serve.run(build_app(CONFIG), name=APP_NAME, route_prefix=ROUTE)
    url = serve_cluster + ROUTE
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the app never became healthy"
        time.sleep(0.5)
    try:
        yield url
    finally:
        serve.delete(APP_NAME)


def replica_states() -> dict[str, int]:
    deployment = serve.status().applications[APP_NAME].deployments["EngineReplica"]
    return {str(getattr(state, "value", state)): n for state, n in deployment.replica_states.items()}


def running_replicas() -> int:
    return replica_states().get("RUNNING", 0)


def wait_for(condition, timeout_s: float, what: str) -> float:
    """Seconds until condition() holds; fails naming `what` and the replica states after timeout_s."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} within {timeout_s} s; replicas: {replica_states()}"
        time.sleep(0.5)
    return time.monotonic() - start


class Load:
    """CLIENTS threads, each streaming long chat completions back to back until stopped (or LOAD_LIMIT_S);
    a stopped client leaves its stream at the next chunk, which cancels the request on the replica."""

    def __init__(self, url: str):
        self.url, self.stop = url, threading.Event()
        self.deadline = time.monotonic() + LOAD_LIMIT_S
        self.chunks, self.errors = 0, []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _running(self) -> bool:
        return not self.stop.is_set() and time.monotonic() < self.deadline

    def _client(self, i: int):
        body = {"messages": [{"role": "user", "content": f"Tell me a long story about robot number {i}."}],
                "max_tokens": 1024, "temperature": 0, "stream": True}
        while self._running():
            try:
                with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=120) as r:
                    if r.status_code != 200:
                        self.errors.append(f"HTTP {r.status_code}")
                        time.sleep(0.5)
                        continue
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.chunks += 1
                        if not self._running():
                            break
            except httpx.HTTPError as e:
                self.errors.append(repr(e))
                time.sleep(0.5)


@pytest.mark.slow
def test_load_scales_up_to_two_replicas_then_back_to_one(app_url):
    assert wait_for(lambda: running_replicas() == 1, 10, "one replica before the load") < 10
    handle = serve.get_deployment_handle("EngineReplica", APP_NAME)
    assert handle.info.remote().result().torch_threads == 1  # 0.5 CPUs still means one torch thread

    with Load(app_url) as load:
        up = wait_for(lambda: running_replicas() == 2, SCALE_TIMEOUT_S, "two running replicas under load")
        assert load.chunks > 0 and not load.errors, load.errors[:3]
    down = wait_for(lambda: replica_states() == {"RUNNING": 1}, SCALE_TIMEOUT_S, "back to one replica after the load")
    print(f"scaled up in {up:.1f} s under load, back down in {down:.1f} s after it")
    assert httpx.get(f"{app_url}/health", timeout=30).status_code == 200
