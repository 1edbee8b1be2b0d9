"""The disaggregated topology (router -> drafter and verifier deployments) on real Ray Serve, through
real HTTP clients: its output equals the in-process Engine's (greedy, and seeded sampling), a client
that leaves and every finished request free their state in BOTH replicas, and a request whose state
a replica loses mid-way is rebuilt by re-prefill from the router's committed tokens, output unchanged.
"""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest
from ray import serve

from conftest import deploy, openai_client
from deployments.app import build_app
from deployments.config import AppConfig
from deployments.disaggregated import Batcher
from deployments.records import RequestParams

APP_NAME = "dflash-disagg-test"
PREFIX = "/disagg"
CONFIG = AppConfig(policy="fixed", topology="disaggregated", draft="random", dtype="float32", max_slots=2, num_cpus=0.5,
                   drafter_num_cpus=0.5)
CHAT_PROMPT = "Write a haiku about the sea."
TEXT_PROMPT = "The three primary colours are"
MAX_TOKENS = 12
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "seed": 7}


@pytest.fixture(scope="module")
def server(serve_cluster):
    yield deploy(build_app(CONFIG), APP_NAME, serve_cluster, PREFIX)
    serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def handles(server):
    return {name: serve.get_deployment_handle(name, APP_NAME) for name in ("Router", "DrafterReplica", "VerifierReplica")}


@pytest.fixture(scope="module")
def reference():
    """Text from a colocated Engine in this process with the server's loading settings."""
    import torch

    from engine.config import build_engine, load_models
    from engine.engine import SamplingParams
    from engine.prompts import chat

    torch.set_num_threads(1)
    loaded = load_models(CONFIG.engine)
    block_size = CONFIG.engine.max_block_size(loaded.drafter)
    engine = build_engine(replace(CONFIG.engine, max_slots=1), loaded)
    tokenizer = loaded.tokenizer

    class Reference:
        def chat_ids(self, text):
            return chat(text).token_ids(tokenizer)

        def text_ids(self, text):
            return tokenizer(text).input_ids

        def text(self, prompt_ids, max_tokens=MAX_TOKENS, **sampling) -> str:
            params = SamplingParams(max_tokens=max_tokens, block_size=block_size, **sampling)
            r = engine.generate_batch([prompt_ids], params)[0]
            return tokenizer.decode(r.output_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    return Reference()


def batching(max_size=4, wait_s=0.05, expected=lambda: 0, fail=False, seconds=0.0):
    """A Batcher over a function that takes `seconds` and records each batch it gets (its argument's list)."""
    batches = []

    async def fn(xs):
        batches.append(list(xs))
        await asyncio.sleep(seconds)
        if fail:
            raise ValueError("the engine failed")
        return [2 * x for x in xs]

    return Batcher(fn, max_size, wait_s, expected=expected), batches


def test_batcher_batches_concurrent_calls_and_waits_for_the_expected_ones():
    """Without Ray: calls made together run as one batch (at most max_size), each caller getting its own
    result; a call waits past wait_s for the calls `expected` says are coming (up to 1.5x a mean batch)."""
    async def late_pair(expected):
        batcher, batches = batching(wait_s=0.002, expected=expected, seconds=0.1)
        await batcher(0)  # a mean batch of 100 ms: a call may wait up to 150 ms
        first = asyncio.create_task(batcher(1))
        await asyncio.sleep(0.05)
        assert await asyncio.gather(first, batcher(2)) == [2, 4]
        return batches[1:]

    async def main():
        batcher, batches = batching()
        assert await asyncio.gather(*(batcher(x) for x in range(6))) == [0, 2, 4, 6, 8, 10]
        assert batches == [[0, 1, 2, 3], [4, 5]]
        assert await late_pair(expected=lambda: 2) == [[1, 2]]
        assert await late_pair(expected=lambda: 0) == [[1], [2]]

    asyncio.run(main())


def test_batcher_passes_errors_on_and_drops_cancelled_calls():
    """The function's error reaches every caller of its batch; a caller that gave up is not in the next."""
    async def main():
        batcher, _ = batching(fail=True)
        results = await asyncio.gather(batcher(1), batcher(2), return_exceptions=True)
        assert all(isinstance(r, ValueError) for r in results)
        batcher, batches = batching()
        gone = asyncio.create_task(batcher(1))
        await asyncio.sleep(0)
        gone.cancel()
        assert await batcher(2) == 4
        assert batches == [[2]]

    asyncio.run(main())


def used(handles) -> tuple[int, int]:
    """KV slots in use in (the drafter replica, the verifier replica)."""
    return tuple(handles[name].slots.remote().result()["used"] for name in ("DrafterReplica", "VerifierReplica"))


def wait_for_no_state(handles, timeout_s=10.0):
    handles["Router"].wait_for_frees.remote().result()
    deadline = time.monotonic() + timeout_s
    while (now := used(handles)) != (0, 0):
        assert time.monotonic() < deadline, f"slots still held (drafter, verifier): {now}"
        time.sleep(0.1)


def completion(client, prompt, stream=False, **kw) -> str:
    out = client.completions.create(model=CONFIG.model_name, prompt=prompt, max_tokens=MAX_TOKENS, stream=stream, **kw)
    return "".join(c.choices[0].text for c in out) if stream else out.choices[0].text


def chat_text(client, prompt, stream=False, **kw) -> str:
    out = client.chat.completions.create(model=CONFIG.model_name, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=MAX_TOKENS, stream=stream, **kw)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in out if c.choices)
    return out.choices[0].message.content


@pytest.mark.slow
def test_config_and_topology(server, handles):
    info = handles["Router"].info.remote().result()
    assert info.topology == "disaggregated" and info.torch_threads == 1 and info.max_slots == CONFIG.engine.max_slots
    assert handles["DrafterReplica"].info.remote().result().torch_threads == 1
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["engine"]["total"] == CONFIG.engine.max_slots


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_greedy_equals_engine(client, reference, handles, stream):
    assert chat_text(client, CHAT_PROMPT, stream, temperature=0) == reference.text(reference.chat_ids(CHAT_PROMPT))
    assert completion(client, TEXT_PROMPT, stream, temperature=0) == reference.text(reference.text_ids(TEXT_PROMPT))
    wait_for_no_state(handles)


@pytest.mark.slow
def test_seeded_sampling_equals_engine(client, reference):
    want = reference.text(reference.text_ids(TEXT_PROMPT), **SAMPLING)
    assert completion(client, TEXT_PROMPT, **SAMPLING) == want
    assert completion(client, TEXT_PROMPT, stream=True, **SAMPLING) == want


@pytest.mark.slow
@pytest.mark.parametrize("role", ["VerifierReplica", "DrafterReplica"])
def test_state_lost_mid_way_is_rebuilt_with_identical_output(client, reference, handles, role):
    """The replica loses every request's state at its 3rd step call: the router re-prefills from its
    committed tokens; greedy and seeded output are unchanged. (A prompt of its own: an earlier reply in the
    drafter's shared suffix index would be copied in fewer calls than the fault waits for.)"""
    for kind, sampling in (("greedy", {"temperature": 0}), ("seeded", SAMPLING)):
        prompt = f"{TEXT_PROMPT} (as the {role} saw them, {kind})"
        rebuilds = handles["Router"].stats.remote().result()["num_rebuilds"]
        handles[role].drop_state_after.remote(3).result()
        assert completion(client, prompt, **sampling) == reference.text(reference.text_ids(prompt), **sampling)
        assert handles["Router"].stats.remote().result()["num_rebuilds"] == rebuilds + 1
    wait_for_no_state(handles)


@pytest.mark.slow
def test_client_disconnect_mid_stream_frees_both_replicas(server, handles):
    cancelled = handles["Router"].stats.remote().result()["num_cancelled"]
    body = {"model": CONFIG.model_name, "prompt": TEXT_PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")
    wait_for_no_state(handles)  # closed: the ingress cancels its router stream, the router frees both replicas
    assert handles["Router"].stats.remote().result()["num_cancelled"] == cancelled + 1


@pytest.mark.slow
def test_router_stream_closed_mid_way_frees_both_replicas(reference, handles):
    """The same at the router's own stream, checking the state was held in both replicas when it closed."""
    stream = handles["Router"].options(stream=True).generate.remote(
        reference.text_ids(TEXT_PROMPT), RequestParams(max_tokens=400, temperature=0.0))
    assert next(stream).token_ids
    deadline = time.monotonic() + 5  # the drafter takes the request's state on its first draft call
    while used(handles) != (1, 1):  # still decoding its 400 tokens
        assert time.monotonic() < deadline, f"state not held in both replicas: {used(handles)}"
        time.sleep(0.05)
    stream.cancel()
    wait_for_no_state(handles)


@pytest.mark.slow
def test_concurrent_requests_share_verify_batches(client, reference, handles):
    """Two requests at once, both running their 24 tokens: the verifier runs their steps together (a batch
    waits for every request with state there) and each output is still the engine's."""
    prompts, max_tokens = ["The history of the Roman Empire", "A list of prime numbers: 2, 3, 5,"], 24
    before = handles["VerifierReplica"].stats.remote().result()
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: client.completions.create(
            model=CONFIG.model_name, prompt=p, max_tokens=max_tokens, temperature=0), prompts))
    after = handles["VerifierReplica"].stats.remote().result()
    assert [o.choices[0].text for o in outs] == [reference.text(reference.text_ids(p), max_tokens) for p in prompts]
    assert all(o.usage.completion_tokens == max_tokens for o in outs)  # neither stopped early: steps to share
    calls, batches = (after[k] - before[k] for k in ("num_batched_calls", "num_batches"))
    assert calls / batches > 1.5, (calls, batches)
    wait_for_no_state(handles)


@pytest.mark.slow
def test_ten_requests_in_a_row_leave_no_state(client, handles):
    for i in range(10):
        client.completions.create(model=CONFIG.model_name, prompt=f"Count to {i}:", max_tokens=4, temperature=0)
    wait_for_no_state(handles)
    stats = handles["Router"].stats.remote().result()
    assert stats["num_failed"] == 0


# ---- the adaptive block policy in the drafter -------------------------------------------------

ADAPTIVE = AppConfig(topology="disaggregated", policy="adaptive", dtype="float32", max_slots=2, block_size=4,
                     num_cpus=0.5, drafter_num_cpus=0.5)  # the trained drafter: real acceptance to learn from


@pytest.mark.slow
def test_adaptive_drafter_learns_from_the_verifier_and_stays_exact(serve_cluster):
    """The drafter replica profiles a cost table at start (on the whole target, before dropping it),
    picks each step's block from it and from what the verifier accepted of its earlier blocks: it
    sees exactly the router's blocks but the last (no draft call follows it). Greedy text unchanged."""
    import torch

    from engine.config import build_engine, load_models
    from engine.engine import SamplingParams
    from engine.prompts import chat

    base = deploy(build_app(ADAPTIVE), "dflash-disagg-adaptive", serve_cluster, "/disagg-adaptive")
    try:
        drafter = serve.get_deployment_handle("DrafterReplica", "dflash-disagg-adaptive")
        assert drafter.info.remote().result().policy == "adaptive"
        torch.set_num_threads(1)
        plain_config = replace(ADAPTIVE.engine, draft="none", max_slots=1)
        loaded = load_models(plain_config)
        plain = build_engine(plain_config, loaded)
        client = openai_client(base)
        for prompt in (CHAT_PROMPT, "Name three rivers in Europe."):
            before = drafter.stats.remote().result()["spec_decoding"]
            out = client.chat.completions.create(model=ADAPTIVE.model_name, max_tokens=24, temperature=0,
                                                 messages=[{"role": "user", "content": prompt}])
            want = plain.generate_batch([chat(prompt).token_ids(loaded.tokenizer)], SamplingParams(max_tokens=24))[0]
            assert out.choices[0].message.content == loaded.tokenizer.decode(
                want.output_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            after = drafter.stats.remote().result()["spec_decoding"]
            router = out.usage.model_extra["spec_decoding"]
            seen = {b: n - before["block_sizes"].get(b, 0) for b, n in after["block_sizes"].items()}
            steps = sum(router["block_sizes"].values())
            assert sum(seen.values()) == steps - 1 and set(seen) <= {1, 2, 3, 4}  # 3: a block cut by max_tokens
            assert after["num_accepted_tokens"] - before["num_accepted_tokens"] <= router["num_accepted_tokens"]
    finally:
        serve.delete("dflash-disagg-adaptive")
