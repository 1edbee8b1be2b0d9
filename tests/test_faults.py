"""Faults in the disaggregated topology on real Ray Serve, with the default model and drafter: a verifier
replica, a drafter replica or one of the verifier's target shards dies mid-stream. The router owns the
committed tokens: it waits until Serve routes to a healthy (restarted) replica, re-prefills it and the
drafter, and the client's streamed greedy text equals the uninterrupted text, three runs in a row.
Afterwards no replica holds a KV slot, no shard placement group is left over, and the router's
counters show the recoveries. With stand-in replicas (no Ray, fast): every kind of failed call is
recovered with the same tokens, and a replica that never comes back ends the request with a clear error
after the deadline, its state freed.
"""

import asyncio
import time
from collections import Counter
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import ray
import torch
from ray import serve
from ray.exceptions import ActorDiedError, RayTaskError

from conftest import deploy, openai_client
from deployments import disaggregated
from deployments.app import build_app
from deployments.config import AppConfig
from deployments.engine_replica import EngineRequestError
from deployments.records import Drafted, Lost, Prefilled, RequestParams, Verified
from engine.engine import SamplingParams
from test_disaggregated import wait_for_no_state
from test_shards import SHARD_CPUS, shard_groups

APP_NAME = "dflash-faults-test"
PREFIX = "/faults"
# DFlash drafts only: faults strike at a set call of a request, so its steps must not depend on the suffix index
CONFIG = AppConfig(policy="fixed", topology="disaggregated", dtype="float32", max_slots=2, num_cpus=0.5, drafter_num_cpus=0.5,
                   proposers="dflash")
SHARDED_CONFIG = AppConfig(**{**CONFIG.model_dump(), "num_shards": 2, "shard_num_cpus": SHARD_CPUS})
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MAX_TOKENS = 48
KILL_AFTER_CHUNKS = 3
NUM_RUNS = 3
DEPLOYMENTS = ("Router", "DrafterReplica", "VerifierReplica")


@pytest.fixture(scope="class")
def app(serve_cluster, request):
    """The app for `request.param` (an AppConfig) on the session cluster: (openai client, handles by name)."""
    base = deploy(build_app(request.param), APP_NAME, serve_cluster, PREFIX)
    yield openai_client(base), {name: serve.get_deployment_handle(name, APP_NAME) for name in DEPLOYMENTS}
    serve.delete(APP_NAME)


def streamed_text(client, kill=None) -> str:
    """The greedy chat answer as streamed; `kill()` runs once KILL_AFTER_CHUNKS chunks have arrived."""
    stream = client.chat.completions.create(model=CONFIG.model_name, messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    text, finish_reason = [], None
    for i, chunk in enumerate(stream):
        if i == KILL_AFTER_CHUNKS and kill is not None:
            kill()
            kill = None
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish_reason = chunk.choices[0].finish_reason or finish_reason
    assert kill is None, "the stream ended before the fault"
    assert finish_reason == "length", "the answer must be long enough to be cut mid-stream"
    return "".join(text)


def replica_actor(deployment: str):
    """The one live replica actor of `deployment` (Serve names it SERVE_REPLICA::app#deployment#id)."""
    prefix = f"SERVE_REPLICA::{APP_NAME}#{deployment}#"
    deadline = time.monotonic() + 30
    while len(names := [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                        if a["name"].startswith(prefix)]) != 1:
        assert time.monotonic() < deadline, f"not one replica of {deployment}: {names}"
        time.sleep(0.2)
    return ray.get_actor(names[0], namespace="serve")


def router_stats(handles) -> dict:
    return handles["Router"].stats.remote().result()


def check_recovered(handles, before: dict, elapsed_s: float) -> dict:
    """Both replicas free again; the router counted a rebuild and no failed request. Returns the stats."""
    wait_for_no_state(handles, timeout_s=30)
    after = router_stats(handles)
    print(f"recovered in {elapsed_s:.1f} s: rebuilds +{after['num_rebuilds'] - before['num_rebuilds']}, "
          f"replica failures +{after['num_replica_failures'] - before['num_replica_failures']} "
          f"{after['replica_failure_causes']}")
    assert after["num_rebuilds"] > before["num_rebuilds"]
    assert after["num_failed"] == before["num_failed"] and after["num_finished"] == before["num_finished"] + 1
    return after


@pytest.mark.slow
@pytest.mark.parametrize("app", [CONFIG], indirect=True, ids=["unsharded"])
class TestReplicaDies:
    @pytest.mark.parametrize("role", ["VerifierReplica", "DrafterReplica"])
    def test_replica_killed_mid_stream_same_text(self, app, role):
        """Runs 1 and 2 ray.kill the replica from outside once chunks arrive (wherever the router is: in a
        call, which then fails, or between calls, when Serve re-routes the next one to the new replica,
        which has no state); run 3 crashes the replica's process in the middle of its 3rd step call, so
        the call fails under the router (counted in num_replica_failures)."""
        client, handles = app
        want = streamed_text(client)
        for run in range(NUM_RUNS):
            before, started = router_stats(handles), time.monotonic()
            if run < NUM_RUNS - 1:
                actor = replica_actor(role)
                assert streamed_text(client, kill=lambda: ray.kill(actor)) == want
            else:
                handles[role].crash_after.remote(3).result()
                assert streamed_text(client) == want
            after = check_recovered(handles, before, time.monotonic() - started)
            if run == NUM_RUNS - 1:
                assert after["num_replica_failures"] > before["num_replica_failures"]


@pytest.mark.slow
@pytest.mark.parametrize("app", [SHARDED_CONFIG], indirect=True, ids=["sharded"])
class TestShardDies:
    def test_shard_killed_mid_stream_same_text(self, app):
        """A killed TargetShard fails the verifier replica's next forwards (the router sees
        RayTaskError(ActorDiedError) and retries) and its next health check (every 2 s): Serve replaces it,
        placement group and shards included, and the router's retries reach the new one and re-prefill it."""
        client, handles = app
        want = streamed_text(client)
        for _ in range(NUM_RUNS):
            before, started = router_stats(handles), time.monotonic()
            shards = handles["VerifierReplica"].shard_actors.remote().result()
            assert len(shards) == 2
            assert streamed_text(client, kill=lambda: ray.kill(shards[1])) == want
            after = check_recovered(handles, before, time.monotonic() - started)
            assert after["num_replica_failures"] > before["num_replica_failures"]
            deadline = time.monotonic() + 30
            while len(groups := [g for g in shard_groups() if len(g["bundles"]) == 3]) != 1:
                assert time.monotonic() < deadline, f"not one verifier placement group: {groups}"
                time.sleep(0.2)


# ---- the router's recovery with stand-in replicas (no Ray) --------------------------------

REPLICA_DIED = ActorDiedError()
# what the router gets when a target shard died under the verifier replica's forward
SHARD_DIED = RayTaskError("verify", "", ActorDiedError(), proctitle="stand-in", pid=1,
                          ip="127.0.0.1").as_instanceof_cause()


class StandIns:
    """A verifier and a drafter holding one request's state, answering like the replicas: the verifier's
    next token is the last one + 1 (no draft accepted); a replica without the state answers Lost.
    `dying` maps a method to the numbers of its calls that raise `error` (the replica died under the
    call and lost the state), or to "always"; with `hang`, every call after a death waits forever."""

    def __init__(self, dying: dict, error: Exception = REPLICA_DIED, hang: bool = False):
        self.dying, self.error, self.hang = dying, error, hang
        self.num_calls, self.freed, self.died = Counter(), [], False
        self.has_state = {"verifier": False, "drafter": False}

    async def _enter(self, method: str, role: str):
        self.num_calls[method] += 1
        if self.died and self.hang:
            await asyncio.sleep(3600)
        when = self.dying.get(method, ())
        if when == "always" or self.num_calls[method] in when:
            self.has_state[role], self.died = False, True
            raise self.error

    async def info(self):
        return SimpleNamespace(stop_token_ids=())

    async def prefill(self, request_id, prompt_ids, output_ids, params):
        await self._enter("prefill", "verifier")
        self.has_state["verifier"] = True
        if isinstance(params, RequestParams):
            params = SamplingParams(**{k: v for k, v in asdict(params).items() if v is not None})
        return Prefilled(params, [] if output_ids else [10], torch.zeros(len(prompt_ids) + len(output_ids), 1))

    async def verify(self, request_id, block_ids, draft_probs, proposer="dflash"):
        await self._enter("verify", "verifier")
        if not self.has_state["verifier"]:
            return Lost()
        return Verified(0, [block_ids[0] + 1], torch.zeros(1, 1))

    async def draft(self, request_id, new_ids, features, start):
        await self._enter("draft", "drafter")
        if start is not None:
            self.has_state["drafter"] = True
        if not self.has_state["drafter"]:
            return Lost()
        return Drafted([new_ids[-1]], None)

    async def free(self, request_id, finished=False):
        self.freed.append(request_id)


class Response:
    def __init__(self, coroutine):
        self.coroutine = coroutine

    def __await__(self):
        return self.coroutine.__await__()

    def cancel(self):
        self.coroutine.close()


class Handle:
    """What the router uses of a DeploymentHandle: options(...), then method.remote(*args), awaited."""

    def __init__(self, stand_ins: StandIns):
        self.stand_ins = stand_ins

    def options(self, **_):
        return self

    def __getattr__(self, name):
        method = getattr(self.stand_ins, name)
        return SimpleNamespace(remote=lambda *args: Response(method(*args)))


def router_over(stand_ins: StandIns, monkeypatch):
    """A Router (the class Serve wraps) whose drafter and verifier handles reach the stand-ins."""
    monkeypatch.setattr(disaggregated, "active_requests_gauge", lambda *_: SimpleNamespace(set=lambda n: None))
    return disaggregated.Router.func_or_class(Handle(stand_ins), Handle(stand_ins),
                                              AppConfig(topology="disaggregated").model_dump())


async def stream(router, max_tokens=8) -> list[int]:
    """One request's streamed token ids; then until its frees have reached both replicas."""
    token_ids = []
    try:
        async for chunk in router.generate([1, 2, 3], RequestParams(max_tokens=max_tokens)):
            token_ids += chunk.token_ids
    finally:
        await router.wait_for_frees()
    return token_ids


@pytest.mark.parametrize("method, error, num_rebuilds", [
    ("prefill", REPLICA_DIED, 0),  # the first prefill
    ("draft", REPLICA_DIED, 1),
    ("verify", REPLICA_DIED, 1),
    ("verify", SHARD_DIED, 1),
], ids=["first-prefill", "draft", "verify", "verify-shard"])
def test_router_recovers_from_a_replica_dying_under_a_call(monkeypatch, method, error, num_rebuilds):
    stand_ins = StandIns({method: (1 if method == "prefill" else 3,)}, error)
    router = router_over(stand_ins, monkeypatch)
    assert asyncio.run(stream(router)) == list(range(10, 18))
    counters = router.counters
    assert counters["num_replica_failures"] == 1 and counters["num_rebuilds"] == num_rebuilds
    assert counters["num_finished"] == 1 and counters["num_failed"] == 0
    assert len(stand_ins.freed) == 2  # both replicas told to free the request


@pytest.mark.parametrize("hang", [False, True], ids=["keeps-failing", "never-answers"])
def test_router_ends_with_a_clear_error_when_no_replica_comes_back(monkeypatch, hang):
    """Until the deadline the router retries with growing pauses (or waits for an answer); then the
    request ends with a 503 naming what failed, and both replicas are told to free it."""
    monkeypatch.setattr(disaggregated, "REPLICA_RECOVERY_S", 0.5)
    monkeypatch.setattr(disaggregated, "RETRY_BACKOFF_S", (0.02, 0.1))
    stand_ins = StandIns({"verify": "always"}, hang=hang)
    router = router_over(stand_ins, monkeypatch)
    started = time.monotonic()
    with pytest.raises(EngineRequestError, match=r"a verifier replica failed under this request \(ActorDiedError\) "
                       r"and no healthy one answered within 0.5 s; retry later") as raised:
        asyncio.run(stream(router))
    assert raised.value.status_code == 503 and router.counters["num_failed"] == 1
    assert 0.5 <= time.monotonic() - started < 2
    assert stand_ins.num_calls["verify"] >= (1 if hang else 3)
    assert len(stand_ins.freed) == 2
