"""Security and overload limits on real Ray Serve through real HTTP: API keys on every route but /health,
the body size limit, no prompts or keys in Ray's logs, bounded queues answered 503 with Retry-After,
and the per-request timeout that frees the request's slot. One small app (one slot, a queue of one,
a 4 s timeout) for the module; the config and loading checks need no server.
"""

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from ray import serve

from conftest import LONG_CHAT, deploy, openai_client
from deployments.app import build_app
from deployments.config import AppConfig

APP_NAME = "dflash-limits"
KEY = "sk-test-0123456789abcdef"
OTHER_KEY = "sk-test-fedcba9876543210"
CONFIG = AppConfig(policy="fixed", draft="random", dtype="float32", max_slots=1, num_cpus=1, max_queued_requests=1,
                   request_timeout_s=4, api_keys=[KEY, OTHER_KEY], max_request_bytes=16384)
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
CANARY = "zebra-canary-prompt-31337"  # a prompt that must never reach a log
LONG = LONG_CHAT  # decodes past the 4 s timeout


@pytest.fixture(scope="module")
def server(serve_cluster):
    yield deploy(build_app(CONFIG), APP_NAME, serve_cluster)
    serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def replica(server):
    return serve.get_deployment_handle("EngineReplica", APP_NAME)


def wait_for_free_slots(replica, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while (slots := replica.slots.remote().result())["used"] or slots["waiting"]:
        assert time.monotonic() < deadline, f"slots still held after {timeout_s} s: {slots}"
        time.sleep(0.1)


def error_of(r: httpx.Response, status: int, code: str | None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error["message"]


def ask(server, headers=AUTH, **kw) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}
    return httpx.post(f"{server}/v1/chat/completions", json=body, headers=headers, timeout=60)


# ---- API keys ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("method, path", [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                          ("GET", "/v1/models"), ("GET", "/openapi.json"), ("GET", "/docs"),
                                          ("GET", "/v1/embeddings")])
def test_every_route_but_health_needs_a_key(server, method, path):
    r = httpx.request(method, server + path, json={"prompt": "Hi"}, timeout=30)
    assert "send it in the header 'Authorization: Bearer" in error_of(r, 401, "missing_api_key")
    assert r.headers["WWW-Authenticate"] == "Bearer"
    wrong = httpx.request(method, server + path, json={"prompt": "Hi"}, timeout=30,
                          headers={"Authorization": "Bearer sk-wrong-key"})
    assert error_of(wrong, 401, "invalid_api_key") == "the API key is not valid"  # never echoes the key
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200


@pytest.mark.slow
def test_right_key_is_served_and_openai_client_errors_are_typed(server):
    import openai

    assert ask(server).status_code == 200
    assert httpx.get(f"{server}/openapi.json", headers=AUTH).json()["info"]["title"] == "dflash-serve"
    client = openai_client(server)
    client.api_key = KEY
    out = client.completions.create(model=CONFIG.model_name, prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens > 0
    client.api_key = KEY + "x"
    with pytest.raises(openai.AuthenticationError, match="not valid"):
        client.completions.create(model=CONFIG.model_name, prompt="Hi", max_tokens=2)
    assert ask(server, headers={"Authorization": f"Basic {KEY}"}).status_code == 401  # Bearer only


# ---- request size -----------------------------------------------------------------------------


@pytest.mark.slow
def test_body_over_the_limit_gets_413_with_or_without_content_length(server, replica):
    body = json.dumps({"prompt": "x" * 20_000, "max_tokens": 2}).encode()
    r = httpx.post(f"{server}/v1/completions", content=body, headers=AUTH, timeout=30)
    assert "larger than this server's limit of 16384 bytes" in error_of(r, 413, "request_too_large")

    def chunks():  # chunked transfer encoding: no Content-Length to check up front
        for i in range(0, len(body), 4096):
            yield body[i:i + 4096]

    r = httpx.post(f"{server}/v1/completions", content=chunks(), headers=AUTH, timeout=30)
    assert "Content-Length" not in r.request.headers
    error_of(r, 413, "request_too_large")
    small = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    r = httpx.post(f"{server}/v1/completions", content=iter([small[:5], small[5:]]), headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text  # a chunked body under the limit is replayed whole to the route
    r = httpx.post(f"{server}/v1/completions", content=small, headers={"Authorization": f"Bearer {KEY}"})
    assert "must be JSON, sent with the header 'Content-Type: application/json'" in error_of(r, 400, None)
    wait_for_free_slots(replica)


# ---- overload and timeouts ----------------------------------------------------------------------


@pytest.mark.slow
def test_full_queue_answers_503_with_retry_after_at_once_and_timeouts_free_everything(server, replica):
    """One slot, two places per replica, one in Serve's queue: A decodes, B and C wait; of four more sent
    together, those that find every place taken are answered 503 with Retry-After at once (Serve counts
    its queue loosely, so which ones is not exact). The 4 s timeout then ends A (an SSE error event) and
    every waiting request (504), and frees everything."""
    results = {}

    def post(name, body):
        start = time.monotonic()
        results[name] = (httpx.post(f"{server}/v1/chat/completions", json=body, headers=AUTH, timeout=60),
                         time.monotonic() - start)

    with httpx.stream("POST", f"{server}/v1/chat/completions", json={**LONG, "stream": True}, headers=AUTH,
                      timeout=60) as a:
        assert a.status_code == 200
        lines = a.iter_lines()
        assert next(lines).startswith("data: ")  # A holds the slot
        threads = []
        for name in ("B", "C", "D1", "D2", "D3", "D4"):
            threads.append(threading.Thread(target=post, args=(name, LONG)))
            threads[-1].start()
            time.sleep(0.5 if name in ("B", "C") else 0)
        for thread in threads:
            thread.join()
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "timeout"  # after the response started: an SSE event
    rejected = {name: seconds for name, (r, seconds) in results.items() if r.status_code == 503}
    assert rejected, {name: r.status_code for name, (r, _) in results.items()}
    for name, (r, seconds) in results.items():
        if name in rejected:
            assert "overloaded" in error_of(r, 503, "overloaded") and r.headers["Retry-After"] == "1"
            assert seconds < 1.0, f"the 503 took {seconds:.2f} s"
        else:
            assert "did not finish within 4 s" in error_of(r, 504, "timeout")
            assert 3.5 < seconds < 8, f"{name} took {seconds:.1f} s"
    assert "B" not in rejected and "C" not in rejected
    print(f"\n503 answered in {', '.join(f'{s * 1000:.0f}' for s in rejected.values())} ms "
          f"({len(rejected)} of 4 over the limit); waiting requests timed out after "
          f"{', '.join(f'{s:.1f}' for n, (_, s) in results.items() if n not in rejected)} s")
    wait_for_free_slots(replica)
    assert ask(server).status_code == 200  # healthy afterwards
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200


@pytest.mark.slow
def test_timeout_ends_a_running_request_and_frees_its_slot(server, replica):
    cancelled = replica.stats.remote().result()["num_cancelled"]
    start = time.monotonic()
    r = httpx.post(f"{server}/v1/chat/completions", json=LONG, headers=AUTH, timeout=60)
    assert "did not finish within 4 s" in error_of(r, 504, "timeout")
    assert 3.5 < time.monotonic() - start < 8
    wait_for_free_slots(replica)
    assert replica.stats.remote().result()["num_cancelled"] == cancelled + 1


DISAGGREGATED = CONFIG.model_copy(update={"topology": "disaggregated", "num_cpus": 0.5, "drafter_num_cpus": 0.5})


@pytest.fixture(scope="module")
def disaggregated(serve_cluster):
    """The same limits in the disaggregated topology, under a route prefix (half a CPU per replica, so both
    apps fit the session's two CPUs)."""
    yield deploy(build_app(DISAGGREGATED), APP_NAME + "-disagg", serve_cluster, route_prefix="/disagg")
    serve.delete(APP_NAME + "-disagg")


@pytest.mark.slow
def test_disaggregated_router_answers_503_when_its_queue_is_full_and_times_out_cleanly(disaggregated):
    """One decoding place: A decodes, B waits in the router; the next ones get 503 with Retry-After at once.
    The timeout then ends A and B, and both replicas hold no state."""
    server = disaggregated
    router = serve.get_deployment_handle("Router", APP_NAME + "-disagg")
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200  # no key for health behind a prefix
    assert ask(server, headers={"Content-Type": "application/json"}).status_code == 401
    results = {}

    def post(name):
        start = time.monotonic()
        results[name] = (httpx.post(f"{server}/v1/chat/completions", json=LONG, headers=AUTH, timeout=60),
                         time.monotonic() - start)

    with httpx.stream("POST", f"{server}/v1/chat/completions", json={**LONG, "stream": True}, headers=AUTH,
                      timeout=60) as a:
        lines = a.iter_lines()
        assert a.status_code == 200 and next(lines).startswith("data: ")
        b = threading.Thread(target=post, args=("B",))
        b.start()
        time.sleep(0.5)
        start = time.monotonic()
        c = ask(server)
        c_seconds = time.monotonic() - start
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    b.join()
    assert "overloaded" in error_of(c, 503, "overloaded") and c.headers["Retry-After"] == "1"
    assert c_seconds < 1.0, f"the 503 took {c_seconds:.2f} s"
    assert json.loads(events[-2])["error"]["code"] == "timeout"
    assert "did not finish within 4 s" in error_of(results["B"][0], 504, "timeout")
    print(f"\ndisaggregated: 503 answered in {c_seconds * 1000:.0f} ms; the queued request timed out after "
          f"{results['B'][1]:.1f} s")
    router.wait_for_frees.remote().result()
    deadline = time.monotonic() + 10
    while (slots := router.slots.remote().result())["used"] or slots["drafter"]["used"]:
        assert time.monotonic() < deadline, f"state still held: {slots}"
        time.sleep(0.1)
    assert ask(server).status_code == 200


# ---- logs ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_no_prompt_or_key_in_the_logs(server):
    import ray

    assert ask(server, messages=[{"role": "user", "content": CANARY}]).status_code == 200
    assert ask(server, messages=[{"role": "user", "content": CANARY}], temperature=-1).status_code == 400
    assert ask(server, headers={"Authorization": f"Bearer {CANARY}"}).status_code == 401
    time.sleep(1)  # Ray flushes worker logs to files asynchronously
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    files = [p for p in logs.rglob("*") if p.is_file()]
    assert any("dflash-limits" in p.read_text(errors="replace") for p in files)  # the app's own logs are here
    for path in files:
        text = path.read_text(errors="replace")
        assert CANARY not in text, f"a prompt is in {path}"
        assert KEY not in text, f"an API key is in {path}"


# ---- configuration and loading (no server) ------------------------------------------------------


def test_keys_never_show_in_the_config_repr_and_come_from_flag_and_environment(monkeypatch):
    from dflash_serve.cli import build_parser, serve_config

    monkeypatch.setenv("DFLASH_API_KEYS", " sk-env-1 ,sk-env-2,")
    args = build_parser()[0].parse_args(["serve", "--api-key", "sk-flag", "--request-timeout-s", "30",
                                         "--max-queued-requests", "5"])
    config = serve_config(args)
    assert [k.get_secret_value() for k in config.api_keys] == ["sk-flag", "sk-env-1", "sk-env-2"]
    assert config.request_timeout_s == 30 and config.max_queued_requests == 5
    assert "sk-" not in repr(config) and "sk-" not in str(config.model_dump())
    # serve run ... api_keys=a,b and a YAML list both work
    assert len(AppConfig.model_validate({"api_keys": "k1,k2"}).api_keys) == 2
    with pytest.raises(ValueError, match="must not be empty"):
        AppConfig(api_keys=[" "])


def test_remote_code_in_a_checkpoint_is_never_run(tmp_path):
    """A checkpoint whose config asks for its own Python (auto_map) fails to load; its code never runs."""
    from engine.hf_target import load_hf_target

    marker = tmp_path / "ran"
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "evil", "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"},
    }))
    (tmp_path / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_hf_target(tmp_path)
    assert not marker.exists()


def test_suffix_drafts_propose_a_keys_own_outputs_only(server):
    """With API keys on, a finished output joins the suffix index of its key only: the same prompt again with
    the same key has its earlier reply proposed and accepted; with the other key it is not (only what its own
    context says). The drafter here is random, so accepted drafts are the suffix proposer's."""
    # 20 tokens: random drafts make every step verify a whole block, and the module's 4 s timeout must
    # not cut the first request short on a slow host (40 tokens took over 4 s on a 2-vCPU AVX2 one)
    body = {"messages": [{"role": "user", "content": "Count from one to twenty in words."}], "max_tokens": 20,
            "temperature": 0}

    def ask_as(key):
        r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        return r.json()

    def suffix_accepted(reply):
        proposers = reply["usage"]["spec_decoding"]["proposers"]
        assert set(proposers) <= {"dflash", "suffix"}
        return proposers.get("suffix", {}).get("num_accepted_tokens", 0)

    first, again, other = ask_as(KEY), ask_as(KEY), ask_as(OTHER_KEY)
    texts = {r["choices"][0]["message"]["content"] for r in (first, again, other)}
    assert len(texts) == 1  # greedy: the same reply whatever drafted it
    tokens = again["usage"]["completion_tokens"]
    assert suffix_accepted(again) >= tokens // 2 > suffix_accepted(other), (suffix_accepted(again), suffix_accepted(other))
