"""The OpenAI-compatible server on real Ray Serve, through real HTTP clients (openai, httpx).

Greedy answers must equal the in-process engine's, token for token, streamed or not; bad input gets
OpenAI-shaped 4xx errors and leaves the server healthy; a client that leaves mid-stream, and every
finished request, frees its KV slots. One Serve application for the whole module (tests/conftest.py
holds the session's Ray cluster). The detokenizer's own tests need no server.
"""

import concurrent.futures
import contextlib
import json
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError
from ray import serve
from ray.serve import Application

from conftest import LONG_CHAT, deploy, openai_client
from deployments.app import build_app
from deployments.config import AppConfig
from deployments.ingress import IncrementalText

ROOT = Path(__file__).resolve().parent.parent

APP_NAME = "dflash-test"
# DFlash drafts only: the lifecycle tests need requests that decode for a while (suffix drafts make a looping reply fast)
CONFIG = AppConfig(policy="fixed", draft="random", dtype="float32", max_slots=4, num_cpus=1, proposers="dflash")
CHAT_PROMPT = "Write a haiku about the sea."
TEXT_PROMPT = "The three primary colours are"
MAX_TOKENS = 24


# ---- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(serve_cluster):
    """The app with CONFIG served at the session's Serve proxy; yields the base URL once /health is ok."""
    yield deploy(build_app(CONFIG), APP_NAME, serve_cluster)
    serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def replica(server):
    return serve.get_deployment_handle("EngineReplica", APP_NAME)


@pytest.fixture(scope="module")
def reference():
    """Greedy text from an Engine in this process with the server's loading settings."""
    import torch

    from engine.config import build_engine, load_models
    from engine.engine import SamplingParams

    torch.set_num_threads(1)
    loaded = load_models(CONFIG.engine)
    block_size = CONFIG.engine.max_block_size(loaded.drafter)
    engine = build_engine(replace(CONFIG.engine, max_slots=1), loaded)
    tokenizer = loaded.tokenizer

    class Reference:
        max_block_size = block_size

        def chat_ids(self, text):
            from engine.prompts import chat

            return chat(text).token_ids(tokenizer)

        def text_ids(self, text):
            return tokenizer(text).input_ids

        def greedy(self, prompt_ids, max_tokens=MAX_TOKENS) -> tuple[str, str, int]:
            """(text, finish reason, completion tokens) for temperature 0."""
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, block_size=block_size)
            r = engine.generate_batch([prompt_ids], params)[0]
            text = tokenizer.decode(r.output_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            return text, r.finish_reason, len(r.output_ids)

    return Reference()


def used_slots(replica) -> int:
    return replica.slots.remote().result()["used"]


def wait_for_free_slots(replica, timeout_s=5.0) -> float:
    """Seconds until the replica holds no KV slots (fails after timeout_s)."""
    start = time.monotonic()
    while (used := used_slots(replica)) != 0:
        assert time.monotonic() - start < timeout_s, f"{used} slots still held after {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - start


def chat_stream(client, **kw) -> tuple[str, list, object]:
    """Stream a chat completion: (text, chunks, usage from the final usage chunk)."""
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks, chunks[-1].usage


def sse_events(response: httpx.Response) -> list:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


# ---- greedy output equals the engine's --------------------------------------------------------


@pytest.mark.slow
def test_health_models_and_replica_info(server, replica):
    info = replica.info.remote().result()
    assert info.torch_threads == CONFIG.torch_threads == 1  # never more threads than reserved CPUs
    assert info.drafter == "random" and info.dtype == "float32" and info.max_slots == CONFIG.engine.max_slots
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["engine"]["total"] == CONFIG.engine.max_slots
    models = httpx.get(f"{server}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [CONFIG.model_name]
    assert models["data"][0]["max_model_len"] == CONFIG.engine.max_len


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_greedy_equals_engine(client, reference, stream):
    want, finish, num_tokens = reference.greedy(reference.chat_ids(CHAT_PROMPT))
    kw = dict(model=CONFIG.model_name, messages=[{"role": "user", "content": CHAT_PROMPT}], max_tokens=MAX_TOKENS,
              temperature=0)
    if stream:
        text, chunks, usage = chat_stream(client, **kw)
        assert chunks[0].choices[0].delta.role == "assistant"
        content = [c for c in chunks if c.choices]
        assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + [finish]
        assert chunks[-1].choices == []
    else:
        out = client.chat.completions.create(**kw)
        text, usage = out.choices[0].message.content, out.usage
        assert out.choices[0].finish_reason == finish and out.choices[0].message.role == "assistant"
    assert text == want
    assert usage.completion_tokens == num_tokens
    assert usage.prompt_tokens == len(reference.chat_ids(CHAT_PROMPT))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = usage.model_extra["spec_decoding"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_drafts"]
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["mean_acceptance_length"] >= 1
    assert set(spec["block_sizes"]) <= {str(b) for b in range(1, reference.max_block_size + 1)}


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_completion_greedy_equals_engine(client, reference, stream):
    want, finish, num_tokens = reference.greedy(reference.text_ids(TEXT_PROMPT))
    kw = dict(model=CONFIG.model_name, prompt=TEXT_PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-2].choices[0].finish_reason == finish
        usage = chunks[-1].usage
    else:
        out = client.completions.create(**kw)
        text, usage = out.choices[0].text, out.usage
        assert out.choices[0].finish_reason == finish
    assert text == want
    assert usage.completion_tokens == num_tokens and usage.prompt_tokens == len(reference.text_ids(TEXT_PROMPT))
    assert "spec_decoding" in usage.model_extra


@pytest.mark.slow
def test_token_id_prompt_and_block_size_extension(client, reference):
    """A prompt given as token ids; block_size 1 (no speculation) still gives the same greedy text."""
    ids = reference.text_ids(TEXT_PROMPT)
    want, _, _ = reference.greedy(ids, max_tokens=8)
    out = client.completions.create(model=CONFIG.model_name, prompt=ids, max_tokens=8, temperature=0,
                                    extra_body={"block_size": 1})
    assert out.choices[0].text == want
    spec = out.usage.model_extra["spec_decoding"]
    assert spec["num_drafts"] == 0 and set(spec["block_sizes"]) == {"1"}


@pytest.mark.slow
def test_the_next_turn_starts_from_the_cached_prompt(client, reference):
    """A prompt that extends an earlier request's prompt and reply starts from that request's cached keys
    and values, says so in usage.prompt_tokens_details.cached_tokens, and gets a full prefill's text."""
    first = "Things to remember: " + ", ".join(f"box {i} holds a {c}" for i, c in enumerate("red blue green" .split() * 8)) + "."
    out = client.completions.create(model=CONFIG.model_name, prompt=first, max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    second = first + out.choices[0].text + " Box 3 holds a"
    want, _, _ = reference.greedy(reference.text_ids(second), max_tokens=8)
    again = client.completions.create(model=CONFIG.model_name, prompt=second, max_tokens=8, temperature=0)
    assert again.choices[0].text == want
    assert again.usage.prompt_tokens_details.cached_tokens >= len(reference.text_ids(first)) - 1


@pytest.mark.slow
def test_seeded_sampling_repeats(client):
    kw = dict(model=CONFIG.model_name, prompt=TEXT_PROMPT, max_tokens=8, temperature=0.9, top_p=0.95, seed=1234,
              extra_body={"top_k": 50})
    first, second = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert first == second and first


# ---- stop strings -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_stop_string_cuts_text(client, reference, replica, stream):
    full, _, num_tokens = reference.greedy(reference.chat_ids(CHAT_PROMPT))
    words = full.split()
    stop = words[len(words) // 2]  # a word in the middle of the greedy answer
    want = full[: full.index(stop)]
    kw = dict(model=CONFIG.model_name, messages=[{"role": "user", "content": CHAT_PROMPT}], max_tokens=MAX_TOKENS,
              temperature=0, stop=["never appears here", stop])
    if stream:
        text, chunks, usage = chat_stream(client, **kw)
        assert all(stop not in (c.choices[0].delta.content or "") for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        out = client.chat.completions.create(**kw)
        text, usage, finish = out.choices[0].message.content, out.usage, out.choices[0].finish_reason
    assert text == want and finish == "stop"
    assert 0 < usage.completion_tokens < num_tokens
    wait_for_free_slots(replica)


# ---- bad input --------------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
BAD_REQUESTS = [  # (id, path, body (dict or raw bytes), status, text the error message must contain, param)
    ("invalid-json", "/v1/chat/completions", b'{"messages": [', 400, "invalid JSON", None),
    ("not-an-object", "/v1/chat/completions", b"[1, 2]", 400, "request body", None),
    ("unknown-model", "/v1/chat/completions", {**CHAT, "model": "gpt-4o"}, 404, "'gpt-4o' does not exist", "model"),
    ("temperature-negative", "/v1/chat/completions", {**CHAT, "temperature": -1}, 400,
     "temperature: Input should be greater than or equal to 0", "temperature"),
    ("temperature-type", "/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400,
     "temperature: Input should be a valid number", "temperature"),
    ("top-p-zero", "/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p: Input should be greater than 0",
     "top_p"),
    ("max-tokens-zero", "/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400,
     "max_tokens: Input should be greater than or equal to 1", "max_tokens"),
    ("n-2", "/v1/chat/completions", {**CHAT, "n": 2}, 400, "only n=1 is supported", "n"),
    ("missing-messages", "/v1/chat/completions", {"max_tokens": 4}, 400, "messages: Field required", "messages"),
    ("empty-messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages:", "messages"),
    ("bad-role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "Hi"}]}, 400, "messages.0.role",
     "messages.0.role"),
    ("missing-prompt", "/v1/completions", {"max_tokens": 4}, 400, "prompt: Field required", "prompt"),
    ("empty-stop", "/v1/completions", {"prompt": "Hi", "stop": ""}, 400, "stop strings must not be empty", "stop"),
    ("prompt-too-long", "/v1/completions", {"prompt": "hello " * 3000}, 400,
     f"context length is {CONFIG.engine.max_len} tokens", None),
    ("max-tokens-too-many", "/v1/chat/completions", {**CHAT, "max_tokens": 100_000}, 400,
     f"context length is {CONFIG.engine.max_len} tokens", None),
    ("token-outside-vocab", "/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "outside the vocabulary", None),
    ("block-size-too-big", "/v1/completions", {"prompt": "Hi", "block_size": 64}, 400, "block_size must be <= ",
     None),
    ("unsupported-penalty", "/v1/chat/completions", {**CHAT, "presence_penalty": 1.5}, 400,
     "presence_penalty is not supported", "presence_penalty"),
    ("unknown-route", "/v1/embeddings", {"input": "Hi"}, 404, "Not Found", None),
]


@pytest.mark.slow
@pytest.mark.parametrize("path, body, status, message, param", [b[1:] for b in BAD_REQUESTS],
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_openai_error(server, path, body, status, message, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error"


@pytest.mark.slow
def test_openai_client_raises_typed_errors_and_server_stays_healthy(client, server, replica):
    import openai
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=CONFIG.model_name, prompt="Hi", top_p=0)
    assert httpx.get(f"{server}/health").status_code == 200
    assert client.completions.create(model=CONFIG.model_name, prompt="Hi", max_tokens=2).usage.completion_tokens > 0
    assert used_slots(replica) == 0


# ---- slots are always given back --------------------------------------------------------------


LONG = LONG_CHAT  # decodes for ~1 min


def num_cancelled(replica) -> int:
    return replica.stats.remote().result()["num_cancelled"]


@pytest.mark.slow
def test_client_disconnect_mid_stream_frees_slot(server, replica):
    cancelled = num_cancelled(replica)
    with httpx.stream("POST", f"{server}/v1/chat/completions", json={**LONG, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")
        assert used_slots(replica) == 1  # still decoding its 1500 tokens
    wait_for_free_slots(replica)  # closed: the ingress cancels its handle call, the replica aborts
    assert num_cancelled(replica) == cancelled + 1


@pytest.mark.slow
def test_client_disconnect_without_streaming_frees_slot(server, replica):
    cancelled = num_cancelled(replica)
    try:
        r = httpx.post(f"{server}/v1/chat/completions", json=LONG, timeout=2)
        pytest.fail(f"answered within the client's 2 s: {r.status_code} {r.text[:500]}")
    except httpx.ReadTimeout:
        pass
    wait_for_free_slots(replica)
    assert num_cancelled(replica) == cancelled + 1


@pytest.mark.slow
def test_disconnect_while_queued_and_while_running(server, replica):
    """All slots busy: a fifth request waits in the replica's queue; leaving frees its place there,
    and the four running ones free their slots when they leave."""
    with contextlib.ExitStack() as running:
        for _ in range(CONFIG.engine.max_slots):
            r = running.enter_context(httpx.stream("POST", f"{server}/v1/chat/completions", timeout=60,
                                                   json={**LONG, "stream": True}))
            assert r.status_code == 200
        assert replica.slots.remote().result() == {"used": 4, "total": 4, "running": 4, "waiting": 0}
        with pytest.raises(httpx.ReadTimeout):  # no slot: no first token, so no response yet
            httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=2)
        deadline = time.monotonic() + 5
        while replica.slots.remote().result()["waiting"]:
            assert time.monotonic() < deadline, "the queued request stayed queued after its client left"
            time.sleep(0.1)
        assert used_slots(replica) == 4
    wait_for_free_slots(replica)


@pytest.mark.slow
def test_hundred_requests_in_a_row_leave_no_slots(server, client, replica):
    for i in range(100):
        if i % 2:
            with httpx.stream("POST", f"{server}/v1/completions", timeout=60,
                              json={"prompt": f"Count to {i}:", "max_tokens": 2, "stream": True}) as r:
                assert sse_events(r)[-1] == "[DONE]"
        else:
            out = client.completions.create(model=CONFIG.model_name, prompt=f"Count to {i}:", max_tokens=2)
            assert out.choices[0].finish_reason in ("length", "stop")
    assert used_slots(replica) == 0


@pytest.mark.slow
def test_more_requests_than_slots_queue(client, replica):
    """Six concurrent requests on four slots: the last ones wait for a slot instead of failing."""
    def ask(i):
        return client.completions.create(model=CONFIG.model_name, prompt=f"Fact number {i}:", max_tokens=6,
                                         temperature=0)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(ask, range(6)))
    assert all(o.choices[0].finish_reason in ("length", "stop") and o.usage.completion_tokens > 0 for o in outs)
    assert used_slots(replica) == 0
    stats = replica.stats.remote().result()
    assert stats["num_finished"] >= 6 and stats["spec_decoding"]["num_drafts"] > 0


# ---- incremental detokenization (no server) ---------------------------------------------------


class ByteTokenizer:
    """One token per UTF-8 byte: the hardest case for incremental decoding."""

    def decode(self, ids, **kw):
        return bytes(ids).decode("utf-8", errors="replace")


def feed(text: IncrementalText, ids: list[int]) -> list[str]:
    deltas = []
    for t in ids:
        deltas.append(text.add([t]))
        if text.stopped:
            break
    if not text.stopped:
        deltas.append(text.flush())
    return deltas


def test_incremental_text_never_emits_broken_utf8():
    s = "héllo 世界 🙂!"
    deltas = feed(IncrementalText(ByteTokenizer(), []), list(s.encode()))
    assert "".join(deltas) == s and not any("\ufffd" in d for d in deltas)


def test_incremental_text_stop_string_is_cut_and_never_sent():
    s = "one two STOP three"
    text = IncrementalText(ByteTokenizer(), ["xyz", "STOP"])
    deltas = feed(text, list(s.encode()))
    assert "".join(deltas) == "one two " and text.stopped
    assert not any("S" in d for d in deltas)  # a possible stop prefix is held back, never released
    assert bytes(text.ids).decode() == "one two STOP"  # usage counts tokens up to the end of the stop string


def test_incremental_text_releases_held_back_prefix_that_is_not_a_stop():
    text = IncrementalText(ByteTokenizer(), ["STOP"])
    assert [text.add([b]) for b in b"a ST"] == ["a", " ", "", ""]
    assert text.add(list(b"ay")) == "STay"


# ---- configuration (no server) ----------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    ({"max_slots": 0}, "max_slots"),
    ({"draft": "/no/such/drafter"}, "no drafter there"),
    ({"target": "/no/such/model"}, "no model there"),
    ({"device": "tpu"}, "device must be 'cpu' or 'cuda"),
    ({"autoscaling_config": {"min_replicas": 3, "max_replicas": 1}}, "max_replicas"),
    ({"max_slot": 4}, "max_slot"),  # a typo is an error, not a silent default
], ids=["max-slots", "draft", "target", "device", "autoscaling", "typo"])
def test_config_rejects_bad_values_by_name(args, message):
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate(args)


def test_builder_takes_serve_run_key_value_args():
    """`serve run deployments.app:build_app key=value ...` hands the builder a dict of strings."""
    args = {"draft": "random", "max_slots": "4", "block_size": "None", "num_cpus": "1",
            "autoscaling_config": '{"min_replicas": 1, "max_replicas": 2}'}
    assert isinstance(build_app(args), Application)
    config = AppConfig.model_validate(args)
    assert config.engine.block_size is None and config.engine.max_slots == 4
    assert config.autoscaling_config["max_replicas"] == 2


def test_serve_config_yaml_is_valid_and_loopback():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((ROOT / "cluster" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw)
    assert schema.http_options.host == "127.0.0.1"
    (application,) = schema.applications
    assert application.import_path == "deployments.app:build_app"
    AppConfig.model_validate(application.args)
