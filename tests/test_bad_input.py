"""Bad input against the real server: schemathesis generates requests from its own OpenAPI schema
(/openapi.json, bounded examples) and checks for 5xx and schema violations; hand-written cases cover
what a generator rarely finds (huge and empty prompts, invalid UTF-8, NaN, thousands of stop strings).
Every one must get a 4xx with a clear message, and the server must stay healthy: a normal request
works afterwards and no KV slot is left held.
"""

import itertools
import json

import httpx
import pytest
from ray import serve

from conftest import deploy
from deployments.app import build_app
from deployments.config import AppConfig

APP_NAME = "dflash-bad-input"
CONFIG = AppConfig(policy="fixed", draft="random", dtype="float32", max_slots=2, max_len=256, num_cpus=1, request_timeout_s=60)
MAX_EXAMPLES = 30  # per operation and mode; the schemathesis run takes about a minute here


@pytest.fixture(scope="module")
def server(serve_cluster):
    yield deploy(build_app(CONFIG), APP_NAME, serve_cluster)
    serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def replica(server):
    return serve.get_deployment_handle("EngineReplica", APP_NAME)


def assert_healthy(server, replica):
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
    slots = replica.slots.remote().result()
    assert slots["used"] == 0 and slots["waiting"] == 0, slots


# ---- schemathesis ---------------------------------------------------------------------------------


def send(case, server) -> httpx.Response:
    """The case's request through httpx (schemathesis' requests transport clashes with urllib3-future here)."""
    kw = case.as_transport_kwargs(base_url=server)
    content = json.dumps(kw["json"]).encode() if "json" in kw else kw.get("data")
    return httpx.request(kw["method"], kw["url"], params=kw.get("params"), headers=kw.get("headers"),
                         content=content, timeout=60)


def steer(body, mode):
    """At most 4 new tokens per generated request, so the run stays short, and valid requests name the
    served model, so they reach the engine instead of all ending 404 (other fields as generated)."""
    if not isinstance(body, dict):
        return
    if mode == "positive" and "model" in body:
        body["model"] = CONFIG.model_name
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if (name == "max_tokens" and value is None) or (type(value) is int and value > 4):
            body[name] = 4


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_and_no_schema_violation(server, replica):
    """Every operation in /openapi.json with generated bodies (valid and invalid by the schema); small
    max_tokens (a hook) keeps generation short. Checks: no 5xx, status codes, content types, headers and
    bodies as the schema documents them."""
    import hypothesis
    import hypothesis.errors
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import load_all_checks
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)

    load_all_checks()
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
    for operation, mode in itertools.product(operations, GenerationMode):

        @hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                             suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        def check(case):
            steer(case.body, mode)
            response = send(case, server)
            assert response.status_code < 500, f"{response.status_code} {response.text[:500]}"
            case.validate_response(response, checks=[status_code_conformance, content_type_conformance,
                                                     response_schema_conformance])

        try:
            check()
        except hypothesis.errors.Unsatisfiable:  # nothing invalid to generate: the operation takes no input
            assert mode == GenerationMode.NEGATIVE and operation.method == "get"
        print(f"{operation.label} ({mode}): {MAX_EXAMPLES} examples at most")
    assert_healthy(server, replica)


# ---- hand-written cases -----------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETIONS, CHATS = "/v1/completions", "/v1/chat/completions"
BAD = [  # (id, path, body (dict, or raw bytes), status, what the message must say)
    ("prompt-over-context", COMPLETIONS, {"prompt": "hello " * 600}, 400, "context length is 256 tokens"),
    ("prompt-plus-max-tokens-over-context", COMPLETIONS, {"prompt": "hello " * 200, "max_tokens": 200}, 400,
     "context length is 256 tokens"),
    ("chat-over-context", CHATS, {"messages": [{"role": "user", "content": "hi " * 600}]}, 400,
     "context length is 256 tokens"),
    ("empty-prompt", COMPLETIONS, {"prompt": ""}, 400, "the prompt is empty"),
    ("empty-token-list", COMPLETIONS, {"prompt": []}, 400, "the prompt is empty"),
    ("empty-nested-token-list", COMPLETIONS, {"prompt": [[]]}, 400, "the prompt is empty"),
    ("invalid-utf8-body", COMPLETIONS, b'{"prompt": "caf\xe9 \xff\xfe", "max_tokens": 2}', 400,
     "invalid JSON body: 'utf-8' codec can't decode"),
    ("lone-surrogate", COMPLETIONS, b'{"prompt": "bad \\ud800 text", "max_tokens": 2}', 400,
     "prompt is not valid Unicode"),
    ("lone-surrogate-in-chat", CHATS, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "content is not valid Unicode"),
    ("nan-temperature", COMPLETIONS, b'{"prompt": "Hi", "temperature": NaN}', 400, "temperature"),
    ("temperature-over-2", CHATS, {**CHAT, "temperature": 2.5}, 400,
     "temperature: Input should be less than or equal to 2 (got 2.5)"),
    ("negative-temperature", CHATS, {**CHAT, "temperature": -0.1}, 400, "temperature: Input should be greater than"),
    ("top-p-over-1", CHATS, {**CHAT, "top_p": 1.5}, 400, "top_p: Input should be less than or equal to 1"),
    ("infinite-top-p", COMPLETIONS, b'{"prompt": "Hi", "top_p": Infinity}', 400, "top_p"),
    ("negative-max-tokens", COMPLETIONS, {"prompt": "Hi", "max_tokens": -5}, 400, "max_tokens"),
    ("huge-max-tokens", COMPLETIONS, {"prompt": "Hi", "max_tokens": 10**30}, 400, "context length is 256 tokens"),
    ("negative-top-k", COMPLETIONS, {"prompt": "Hi", "top_k": -1}, 400, "top_k"),
    ("huge-top-k", COMPLETIONS, {"prompt": "Hi", "top_k": 10**30}, 400, "top_k"),
    ("huge-seed", COMPLETIONS, {"prompt": "Hi", "seed": 2**70}, 400, "seed"),
    ("negative-seed", COMPLETIONS, {"prompt": "Hi", "seed": -3}, 400, "seed"),
    ("huge-block-size", COMPLETIONS, {"prompt": "Hi", "block_size": 10**12}, 400, "block_size must be <="),
    ("zero-block-size", COMPLETIONS, {"prompt": "Hi", "block_size": 0}, 400, "block_size"),
    ("token-id-negative", COMPLETIONS, {"prompt": [1, -2]}, 400, "outside the vocabulary"),
    ("token-id-huge", COMPLETIONS, {"prompt": [10**30]}, 400, "outside the vocabulary"),
    ("unknown-model", CHATS, {**CHAT, "model": "gpt-5"}, 404, "'gpt-5' does not exist"),
    ("max-tokens-as-string", CHATS, {**CHAT, "max_tokens": "4"}, 400, "max_tokens: Input should be a valid integer"),
    ("temperature-as-bool", CHATS, {**CHAT, "temperature": True}, 400, "temperature"),
    ("stream-as-string", CHATS, {**CHAT, "stream": "yes"}, 400, "stream"),
    ("content-as-number", CHATS, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("messages-as-object", CHATS, {"messages": {"role": "user"}}, 400, "messages"),
    ("unsupported-extra-field", CHATS, {**CHAT, "logit_bias": {"5": 10}}, 400, "logit_bias is not supported"),
    ("thousands-of-stops", COMPLETIONS, {"prompt": "Hi", "stop": [f"s{i}" for i in range(5000)]}, 400,
     "at most 16 stop strings"),
    ("huge-stop-string", COMPLETIONS, {"prompt": "Hi", "stop": "x" * 1000}, 400, "at most 256 characters"),
    ("stop-as-number", COMPLETIONS, {"prompt": "Hi", "stop": 7}, 400, "stop"),
    ("body-is-a-string", COMPLETIONS, b'"Hi"', 400, "request body"),
    ("empty-body", COMPLETIONS, b"", 400, "the request body is missing"),
]


@pytest.mark.slow
@pytest.mark.parametrize("path, body, status, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_4xx(server, path, body, status, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"], error
    assert error["type"] == "invalid_request_error"


@pytest.mark.slow
def test_sampling_ranges_are_openais_and_the_error_names_the_field(server):
    """temperature in [0, 2], top_p in (0, 1]: outside, a 400 whose param is the field (a temperature of 50
    once ran for minutes, sampling near-uniformly over the vocabulary)."""
    for field, value in (("temperature", 2.01), ("temperature", 50), ("top_p", 1.01)):
        r = httpx.post(server + CHATS, json={**CHAT, field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.slow
def test_unknown_extra_fields_are_ignored_and_tiny_temperature_is_greedy(server, replica):
    greedy = httpx.post(f"{server}/v1/completions", timeout=60,
                        json={"prompt": "The sky is", "max_tokens": 6, "temperature": 0}).json()
    tiny = httpx.post(f"{server}/v1/completions", timeout=60,
                      json={"prompt": "The sky is", "max_tokens": 6, "temperature": 1e-300, "user": "u1",
                            "metadata": {"a": [1, 2]}, "x_unknown": None}).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert_healthy(server, replica)


@pytest.mark.slow
def test_server_healthy_after_all_bad_input(server, replica):
    assert_healthy(server, replica)
    assert httpx.get(f"{server}/health", timeout=30).json()["status"] == "ok"
