"""The server's Prometheus metrics, through `ray.serve.metrics` (each node's Ray metrics agent exports
them; Prometheus scrapes it: see cluster/prometheus.yml). Ray prefixes every name with `ray_` and
counters with a `_total` suffix: `dflash_num_drafts` is scraped as `ray_dflash_num_drafts_total`.

It owns the metric names, buckets and labels; it knows nothing about HTTP or Serve's wiring: the
deployments call it with numbers. The speculative counters follow vLLM's schema (REFERENCE.md 6):
mean acceptance length = 1 + accepted / drafts, acceptance rate = accepted / draft tokens,
per-position acceptance = accepted_per_pos / drafts. Serve adds deployment, replica and application
labels; every metric here also has `model` and `topology`.
"""

import threading
import time

import torch
from ray.serve.metrics import Counter, Gauge, Histogram

PREFIX = "dflash_"
LABELS = ("model", "topology")
# Ray exports a histogram's _sum from its bucket midpoints, not the observed values: counts (acceptance
# length, block size, batch size) get buckets centred on integers, so the sums stay exact up to 16.
TOKEN_BUCKETS = [n + 0.5 for n in range(17)] + [24.5, 32.5]
BATCH_BUCKETS = [n + 0.5 for n in range(9)] + [12.5, 16.5, 24.5, 32.5, 64.5, 128.5]
STEP_BUCKETS_S = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5]
GAUGE_REFRESH_S = 5
REQUEST_BUCKETS_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300]


def _labels(model: str, topology: str) -> dict:
    return {"model": model, "topology": topology}


def _counter(name: str, description: str, labels: dict, extra: tuple = ()) -> Counter:
    counter = Counter(PREFIX + name, description, tag_keys=LABELS + extra)
    counter.set_default_tags(dict(labels))  # Serve adds its tags to the dict it gets
    return counter


def _histogram(name: str, description: str, buckets: list, labels: dict, extra: tuple = ()) -> Histogram:
    histogram = Histogram(PREFIX + name, description, boundaries=buckets, tag_keys=LABELS + extra)
    histogram.set_default_tags(dict(labels))  # Serve adds its tags to the dict it gets
    return histogram


class LiveGauge:
    """A gauge that stays exported while its replica lives: Ray drops a gauge value that was not set
    for two export intervals, so a daemon thread sets the last value again every GAUGE_REFRESH_S."""

    _all: list["LiveGauge"] = []
    _refresher: threading.Thread | None = None

    def __init__(self, name: str, description: str, labels: dict):
        self._gauge = Gauge(PREFIX + name, description, tag_keys=LABELS)
        self._gauge.set_default_tags(dict(labels))  # Serve adds its tags to the dict it gets
        self._value: float | None = None
        self._lock = threading.Lock()
        LiveGauge._all.append(self)
        if LiveGauge._refresher is None:
            LiveGauge._refresher = threading.Thread(target=LiveGauge._refresh_forever, name="gauges", daemon=True)
            LiveGauge._refresher.start()

    def set(self, value: float):
        with self._lock:
            self._value = value
            self._gauge.set(value)

    @staticmethod
    def _refresh_forever():
        while True:
            time.sleep(GAUGE_REFRESH_S)
            for gauge in list(LiveGauge._all):
                with gauge._lock:
                    if gauge._value is not None:
                        gauge._gauge.set(gauge._value)


def active_requests_gauge(model: str, topology: str) -> LiveGauge:
    """Requests holding state in a replica (an engine replica, a drafter, a verifier) or in flight in the router."""
    return LiveGauge("active_requests", "Requests holding state in this replica, or in flight in the router.",
                     _labels(model, topology))


class EngineMetrics:
    """What an engine replica records: its forward passes (draft, verify), the speculative counters
    (from verify, where acceptance is decided: the colocated replica or a verifier) and its load.
    One per replica; safe to call from the engine thread."""

    def __init__(self, model: str, topology: str):
        labels = _labels(model, topology)
        by_proposer = ("proposer",)  # "dflash" (the drafter) or "suffix" (what the context already said)
        self.num_drafts = _counter("num_drafts", "Verified blocks with at least one drafted token.", labels, by_proposer)
        self.num_draft_tokens = _counter("num_draft_tokens", "Drafted tokens sent to verification.", labels, by_proposer)
        self.num_accepted_tokens = _counter("num_accepted_tokens", "Drafted tokens the target accepted.", labels,
                                            by_proposer)
        self.num_accepted_tokens_per_pos = _counter(
            "num_accepted_tokens_per_pos", "Accepted drafted tokens by position in the block (0 = first draft).",
            labels, ("position",))
        self.acceptance_length = _histogram(
            "acceptance_length", "Tokens committed per verified draft (1 + accepted).", TOKEN_BUCKETS, labels)
        self.block_size = _histogram(
            "block_size", "Block size chosen per request and step (1 = no speculation).", TOKEN_BUCKETS, labels)
        self.batch_size = _histogram(
            "batch_size", "Requests in one forward pass, by pass (draft or verify).", BATCH_BUCKETS, labels,
            ("forward",))
        self.draft_latency = _histogram(
            "draft_latency_seconds", "Wall time of one batched drafter pass.", STEP_BUCKETS_S, labels)
        self.verify_latency = _histogram(
            "verify_latency_seconds", "Wall time of one batched verify pass (target forward + acceptance).",
            STEP_BUCKETS_S, labels)
        self.active_requests = active_requests_gauge(model, topology)
        self.used_kv_slots = LiveGauge("used_kv_slots", "KV-cache slots in use in this replica.", labels)

    def instrument(self, engine):
        """Time `engine.draft` and `engine.verify` and record what each pass did, wherever they are called
        from (Engine.step in the colocated replica, the disaggregated replicas directly)."""
        draft, verify = engine.draft, engine.verify

        def timed_draft(requests, block_sizes):
            start = time.perf_counter()
            out = draft(requests, block_sizes)
            if out.block_ids.is_cuda:
                torch.cuda.synchronize(out.block_ids.device)  # else this times the kernel launches only
            if max(block_sizes) > 1:  # a block of 1 runs no drafter pass
                self.draft_latency.observe(time.perf_counter() - start)
                self.batch_size.observe(len(requests), {"forward": "draft"})
            return out

        def timed_verify(requests, block):
            start = time.perf_counter()
            num_accepted, next_ids, features = verify(requests, block)
            self.verify_latency.observe(time.perf_counter() - start)
            self.batch_size.observe(len(requests), {"forward": "verify"})
            proposers = block.proposers or ["dflash"] * len(block.block_sizes)
            for block_size, accepted, proposer in zip(block.block_sizes, num_accepted, proposers):
                self.observe_verified(block_size - 1, accepted, proposer)
            return num_accepted, next_ids, features

        engine.draft, engine.verify = timed_draft, timed_verify

    def observe_verified(self, num_draft_tokens: int, num_accepted: int, proposer: str = "dflash"):
        """One request's verified block: the same accounting as SpecStats.observe_draft."""
        self.block_size.observe(num_draft_tokens + 1)
        if num_draft_tokens == 0:
            return
        tags = {"proposer": proposer}
        self.num_drafts.inc(1, tags)
        self.num_draft_tokens.inc(num_draft_tokens, tags)
        if num_accepted:
            self.num_accepted_tokens.inc(num_accepted, tags)
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos.inc(1, {"position": str(position)})
        self.acceptance_length.observe(1 + num_accepted)

    def set_load(self, num_active: int, num_used_slots: int | None = None):
        self.active_requests.set(num_active)
        if num_used_slots is not None:
            self.used_kv_slots.set(num_used_slots)


class RequestMetrics:
    """What the ingress records per request, as its client sees it: time to first token, the gaps
    between streamed chunks (a speculative step commits several tokens at once: one gap per step),
    end-to-end latency and the tokens generated."""

    def __init__(self, model: str, topology: str):
        labels = _labels(model, topology)
        self.ttft = _histogram("ttft_seconds", "Time from request to its first token.", REQUEST_BUCKETS_S, labels)
        self.itl = _histogram(
            "itl_seconds", "Inter-token latency: time between consecutive chunks of committed tokens.",
            STEP_BUCKETS_S, labels)
        self.e2e = _histogram(
            "e2e_latency_seconds", "Time from request to its last token.", REQUEST_BUCKETS_S, labels)
        self.num_generated_tokens = _counter(
            "num_generated_tokens", "Tokens generated for clients (committed by the engine).", labels)
        self.num_prompt_tokens = _counter("num_prompt_tokens", "Prompt tokens of requests that got a first token.", labels)
        self.num_cached_prompt_tokens = _counter(
            "num_cached_prompt_tokens", "Prompt tokens taken from another request's KV cache, not prefilled "
            "(prefix caching).", labels)
        self.num_requests = _counter(
            "num_requests", "Requests ended, by finish reason: stop, length, or abort (an error, a timeout or the client left).", labels,
            ("finish_reason",))

    def observe_chunk(self, num_tokens: int, since_start_s: float, since_last_s: float | None):
        """A chunk of committed tokens arrived; since_last_s is None for the first one."""
        if since_last_s is None:
            self.ttft.observe(since_start_s)
        else:
            self.itl.observe(since_last_s)
        if num_tokens:
            self.num_generated_tokens.inc(num_tokens)

    def observe_prompt(self, num_tokens: int, num_cached: int):
        """A request got its first token: its prompt's size, and how much of it came from a prefix cache."""
        self.num_prompt_tokens.inc(num_tokens)
        if num_cached:
            self.num_cached_prompt_tokens.inc(num_cached)

    def observe_finished(self, finish_reason: str, e2e_s: float | None):
        """A request ended; e2e_s is None when it did not finish (abort)."""
        self.num_requests.inc(1, {"finish_reason": finish_reason})
        if e2e_s is not None:
            self.e2e.observe(e2e_s)
