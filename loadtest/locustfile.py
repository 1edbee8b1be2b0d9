"""Locust users for chat, RAG and agent traffic over the OpenAI API, streaming.

Run by `dflash-serve loadtest` (loadtest/run.py) as its own process, or by hand (from the repository
root; the traffic is built into the cache directory on first use unless --scenario-file names a file):

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000                  # web UI on :8089
    locust -f loadtest/locustfile.py --headless -u 4 -r 4 -t 60s --host http://127.0.0.1:8000 ChatUser

Every request is one streaming chat completion through the official `openai` client. Its
latencies are Locust events named after the scenario, so Locust's stats, CSV and web UI show them:
  TTFT  request sent -> first text;  ITL  each gap between chunks carrying text;
  TPOT  (end-to-end - TTFT) / (output tokens - 1);  E2E  end-to-end, response_length = output tokens.
A request that raises, times out or ends without a finish reason is an E2E failure. At the end
the process writes --summary-json: per scenario, tokens, wall time and the server's speculative
decoding stats (usage.spec_decoding), and Locust's percentiles of each event. Load shapes: steady users (default), Poisson think times
(--think-time S: each user waits an exponential time of mean S between requests) and a step ramp
(with loadtest/step_shape.py as a second locustfile).
"""

import json
import random
import time
from collections import Counter

import gevent
from locust import User, events, task
from locust.exception import StopUser

from loadtest.replies import parse_json_object

SUMMARY: dict[str, dict] = {}
_USERS_STARTED: Counter = Counter()  # scenario -> users started so far in this process


@events.init_command_line_parser.add_listener
def _arguments(parser):
    parser.add_argument("--scenario-file", default=None,
                        help="traffic built by loadtest/scenarios.py (default: built into the cache directory on first use)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--think-time", type=float, default=0.0, help="mean exponential wait between requests (s)")
    parser.add_argument("--max-requests", type=int, default=0, help="stop after this many requests (0: no limit)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="client timeout per request (s)")
    parser.add_argument("--summary-json", default=None, help="write per-scenario totals here at the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default="loadtest", help="the key the users send (a server with keys on)")
    parser.add_argument("--block-size", type=int, default=0, help="the request's block_size extension (0: the server's)")
    parser.add_argument("--step-users", type=int, default=4, help="step shape: users added per step")
    parser.add_argument("--step-time", type=float, default=20.0, help="step shape: seconds per step")


@events.init.add_listener
def _init(environment, **kw):
    SUMMARY["_environment"] = environment
    options = environment.parsed_options
    if options is not None and options.scenario_file is None:
        from loadtest.scenarios import cached_file  # imports torch: only when the traffic is needed

        options.scenario_file = str(cached_file(options.seed))


@events.test_start.add_listener
def _start(environment, **kw):
    SUMMARY.clear()
    SUMMARY.update({"_environment": environment, "_wall": {"start": time.time(), "end": None}})


@events.quit.add_listener
def _quit(exit_code, **kw):
    """After the last request (whether the run ended by time or by --max-requests): the totals and
    Locust's own stats per scenario (the figures its console, CSV and web UI show)."""
    environment = SUMMARY.pop("_environment", None)
    path = environment.parsed_options.summary_json if environment and environment.parsed_options else None
    if not path:
        return
    for entry in environment.runner.stats.entries.values():
        totals = SUMMARY.get(entry.name)
        if totals is not None:
            totals.setdefault("locust_stats", {})[entry.method] = {
                "count": entry.num_requests, "failures": entry.num_failures,
                **{f"p{p}": entry.get_response_time_percentile(p / 100) for p in (50, 90, 99)}}
    with open(path, "w") as f:
        json.dump(SUMMARY, f, indent=1)


def _totals(scenario: str) -> dict:
    return SUMMARY.setdefault(scenario, {
        "requests": 0, "failures": 0, "output_tokens": 0, "prompt_tokens": 0, "num_drafts": 0,
        "num_accepted_tokens": 0, "block_sizes": Counter(), "valid_json": 0, "json_expected": 0})


class OpenAIUser(User):
    """A user with an `openai` client; `chat()` streams one request and records it."""

    abstract = True
    scenario = "base"

    def wait_time(self):
        mean = self.environment.parsed_options.think_time
        return self.rng.expovariate(1 / mean) if mean > 0 else 0

    def on_start(self):
        import openai

        options = self.environment.parsed_options
        self.options = options
        # the n-th user of a scenario replays the same traffic in every run: compared variants see the same prompts
        index = _USERS_STARTED[self.scenario]
        _USERS_STARTED[self.scenario] += 1
        self.rng = random.Random(f"{options.seed}/{self.scenario}/{index}")
        self.data = json.loads(open(options.scenario_file).read())
        self.client = openai.OpenAI(base_url=self.host.rstrip("/") + "/v1", api_key=self.options.api_key,
                                    timeout=options.request_timeout, max_retries=0)
        self.model = self.client.models.list().data[0].id

    def chat(self, messages: list[dict], expect_json: bool = False) -> str | None:
        """Stream one chat completion; its text, or None when it failed (recorded as a failure)."""
        if self._limit_reached():
            raise StopUser()  # --max-requests: start nothing new; requests in flight finish
        fire = self.environment.events.request.fire
        totals = _totals(self.scenario)
        start = time.perf_counter()
        first = last = None
        text, usage, finish = "", None, None
        try:
            stream = self.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=self.options.max_tokens,
                temperature=self.options.temperature, stream=True, stream_options={"include_usage": True},
                extra_body={"block_size": self.options.block_size} if self.options.block_size else None)
            for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta.content:
                        if first is None:
                            first = now
                            fire(request_type="TTFT", name=self.scenario, response_time=(now - start) * 1000,
                                 response_length=0, exception=None, context={})
                        else:
                            fire(request_type="ITL", name=self.scenario, response_time=(now - last) * 1000,
                                 response_length=0, exception=None, context={})
                        last = now
                        text += choice.delta.content
                    finish = choice.finish_reason or finish
            if finish is None or usage is None:
                raise RuntimeError("the stream ended without a finish reason or usage")
        except Exception as e:  # every failure counts, and the user goes on
            totals["requests"] += 1
            totals["failures"] += 1
            fire(request_type="E2E", name=self.scenario, response_time=(time.perf_counter() - start) * 1000,
                 response_length=0, exception=e, context={})
            self._count_request()
            return None
        end = time.perf_counter()
        tokens = usage.completion_tokens
        if first is not None and tokens > 1:
            fire(request_type="TPOT", name=self.scenario, response_time=(end - first) * 1000 / (tokens - 1),
                 response_length=0, exception=None, context={})
        fire(request_type="E2E", name=self.scenario, response_time=(end - start) * 1000, response_length=tokens,
             exception=None, context={})
        spec = (usage.model_extra or {}).get("spec_decoding") or {}
        totals["requests"] += 1
        totals["output_tokens"] += tokens
        totals["prompt_tokens"] += usage.prompt_tokens
        totals["num_drafts"] += spec.get("num_drafts", 0)
        totals["num_accepted_tokens"] += spec.get("num_accepted_tokens", 0)
        totals["block_sizes"].update({int(b): n for b, n in spec.get("block_sizes", {}).items()})
        if expect_json:
            totals["json_expected"] += 1
            totals["valid_json"] += parse_json_object(text) is not None
        SUMMARY["_wall"]["end"] = time.time()
        self._count_request()
        return text

    def _count_request(self):
        if self._limit_reached():
            gevent.spawn(self.environment.runner.quit)

    def _limit_reached(self) -> bool:
        limit = self.options.max_requests
        return bool(limit) and sum(v["requests"] for k, v in SUMMARY.items() if not k.startswith("_")) >= limit


class ChatUser(OpenAIUser):
    """Replays a ShareGPT conversation turn by turn (one request per task), the server's replies
    kept in the history; then starts another conversation."""

    scenario = "chat"

    def on_start(self):
        super().on_start()
        self.turns, self.history = [], []

    @task
    def turn(self):
        if not self.turns:
            self.turns, self.history = list(self.rng.choice(self.data["chat"])), []
        self.history.append({"role": "user", "content": self.turns.pop(0)})
        reply = self.chat(self.history)
        if reply is None:
            self.turns = []  # a failed turn ends the conversation
        else:
            self.history.append({"role": "assistant", "content": reply})


class RagUser(OpenAIUser):
    """One question with its retrieved passages per request."""

    scenario = "rag"

    @task
    def ask(self):
        item = self.rng.choice(self.data["rag"])
        self.chat([{"role": "user", "content": item["prompt"]}])


class AgentUser(OpenAIUser):
    """A task: ask for a JSON tool call, send back the tool's result, ask for a JSON answer
    (two requests). The observation is the real result of the call the task needs, whatever
    the model replied; how often the replies were valid JSON is in the summary."""

    scenario = "agent"

    @task
    def solve(self):
        agent = self.data["agent"]
        item = self.rng.choice(agent["tasks"])
        messages = [{"role": "system", "content": agent["system"]}, {"role": "user", "content": item["task"]}]
        reply = self.chat(messages, expect_json=True)
        if reply is None:
            return
        messages += [{"role": "assistant", "content": reply}, {"role": "tool", "content": item["observation"]}]
        self.chat(messages, expect_json=True)
