"""The disaggregated topology: a router that owns every request's committed tokens, drafter replicas
(the drafter plus the target's embedding and LM head) and verifier replicas (the target).

Replica state (KV slots and mirror Requests) is a cache of the router's truth: a replica that lacks
a request's state answers Lost, and the router rebuilds it by re-prefilling from the committed
tokens, so the output is unchanged (a seeded request's tokens are functions of its seed and positions).
A replica (or a target shard under it) that dies under a call is lost state too: the router retries
with growing pauses until Serve routes to a healthy replica, for at most REPLICA_RECOVERY_S.
Both replicas run the colocated topology's engine code through its public methods (Engine.draft,
trim, verify, commit) on mirror Requests; they exchange the records of deployments/records.py.
Sticky routing is Serve model multiplexing keyed by request id; its LRU eviction also frees
abandoned state. Nothing here knows HTTP or text.
"""

import asyncio
import contextlib
import contextvars
import logging
import os
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace

import torch
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from deployments.config import AppConfig
from deployments.engine_replica import EngineRequestError, cost_table_tag, replica_info, sampling_params, start_engine
from deployments.metrics import active_requests_gauge
from deployments.records import Chunk, Drafted, DraftStart, Lost, Prefilled, ReplicaInfo, RequestParams, Verified
from deployments.shards import ShardedTarget, check_shards, start_shards
from engine.config import build_engine, load_models
from engine.engine import DraftBlock, Engine, Request, SamplingParams
from engine.model import TargetHead
from engine.suffix import Proposal

logger = logging.getLogger("ray.serve")

BATCH_WAIT_S = 0.002  # how long a replica waits for other requests' steps to join a batch, at least
BATCH_WAIT_SHARE = 1.5  # and at most this share of its mean batch time, while requests with state here are missing
NUM_FREED_REMEMBERED = 4096  # freed request ids a replica remembers, so a late prefill cannot revive one
MAX_REBUILDS_PER_STEP = 3  # rebuilds of state that live replicas lost, per step
REPLICA_RECOVERY_S = 60  # how long a request waits for a healthy replica after one died under a call
RETRY_BACKOFF_S = (0.1, 2.0)  # the first and the longest pause between calls while replicas keep failing
# Serve checks each replica this often and replaces one that died or fails the check (a verifier that lost a shard)
HEALTH_CHECK_PERIOD_S = 2


# ---- what both replicas share ---------------------------------------------------------------


class Batcher:
    """Gathers concurrent calls into batches for one function of lists, at most `max_size` calls each.

    A call that finds the function idle waits for the others `expected()` says are coming (the requests that
    have state here: each loops between drafter and verifier), for at most `wait_share` of a batch's mean
    time (and at least `wait_s`); calls that arrive while a batch runs make the next one. Waiting keeps the
    requests in step: unbatched, they drift into groups that each pay a whole pass. (Serve's @serve.batch
    splits a batch by multiplexed model id, and here every request is a model id of its own: it never
    batched two requests.) Counts its batches, their calls and their time."""

    def __init__(self, fn, max_size: int, wait_s: float, expected=lambda: 0, wait_share: float = BATCH_WAIT_SHARE):
        self.fn, self.max_size, self.wait_s, self.expected, self.wait_share = fn, max_size, wait_s, expected, wait_share
        self._queue: list[tuple[tuple, asyncio.Future]] = []
        self._running: asyncio.Task | None = None
        self._arrived = asyncio.Event()
        self.num_batches, self.num_calls, self.seconds = 0, 0, 0.0

    async def __call__(self, *args):
        future = asyncio.get_running_loop().create_future()
        self._queue.append((args, future))
        self._arrived.set()
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._run())
        return await future

    async def _gather(self):
        """Until max_size calls are queued, or the expected ones are and wait_s has passed, or the wait is up."""
        mean = self.seconds / self.num_batches if self.num_batches else 0.0
        start = time.monotonic()
        least, most = start + self.wait_s, start + max(self.wait_s, self.wait_share * mean)
        while len(self._queue) < self.max_size:
            now = time.monotonic()
            if now >= most or (now >= least and len(self._queue) >= self.expected()):
                return
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), (least if now < least else most) - now)

    async def _run(self):
        while self._queue:
            await self._gather()
            batch, self._queue = self._queue[: self.max_size], self._queue[self.max_size :]
            batch = [(args, future) for args, future in batch if not future.done()]  # a cancelled caller's call is dropped
            if not batch:
                continue
            start = time.perf_counter()
            try:
                results = await self.fn(*map(list, zip(*(args for args, _ in batch))))
            except Exception as e:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
            else:
                for (_, future), result in zip(batch, results):
                    if not future.done():
                        future.set_result(result)
            self.num_batches, self.num_calls = self.num_batches + 1, self.num_calls + len(batch)
            self.seconds += time.perf_counter() - start

    def stats(self) -> dict:
        return {"num_batches": self.num_batches, "num_batched_calls": self.num_calls,
                "mean_batch_ms": round(1e3 * self.seconds / max(self.num_batches, 1), 2)}


class _Held:
    """A request's entry in Serve's multiplexing LRU, holding its mirror Request. When Serve evicts
    the entry it calls __del__ (on some thread): the state is queued to be freed on the engine thread."""

    def __init__(self, request_id: str, evicted: list):
        self.request_id, self.request, self._evicted, self._queued = request_id, None, evicted, False

    def __del__(self):
        if not self._queued:
            self._queued = True
            self._evicted.append(self)


class _MirrorReplica:
    """One Engine on one thread, and request id -> mirror Request, kept by Serve's multiplexing LRU.
    Invariant: `self._held[id].request` is the only live mirror of request `id` in this replica; a
    freed id stays in `self._freed` so a call that arrives after its free cannot recreate it."""

    def _start(self, config: dict, role: str, build):
        self.config = AppConfig.model_validate(config)
        threads = self.config.drafter_torch_threads if role == "drafter" else self.config.torch_threads
        self._executor, self.engine, self._info, self.metrics = start_engine(self.config, threads, build)
        self.num_slots = self.engine.target_cache.num_slots
        self._held: dict[str, _Held] = {}
        self._evicted: list[_Held] = []
        self._freed: OrderedDict[str, None] = OrderedDict()
        self._fault: tuple[str, int] | None = None  # a test hook's (kind, calls until it strikes)
        self.counters = {"num_evicted": 0, "num_missing": 0}

        async def hold(request_id: str) -> _Held:
            return _Held(request_id, self._evicted)

        # one LRU entry per request with state here, at most one per KV slot: loading a new one evicts the oldest
        self._hold = serve.multiplexed(max_num_models_per_replica=self.num_slots)(hold)

    async def _on_engine(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _batcher(self, fn, wait_for_all: bool) -> Batcher:
        """Batches of concurrent calls of fn (a function of lists, run on the engine thread); wait_for_all:
        a batch waits for every request with state here (one side only: both waiting, each would wait for
        the requests the other holds)."""
        return Batcher(lambda *lists: self._on_engine(fn, *lists), self.num_slots, BATCH_WAIT_S,
                       expected=(lambda: len(self._held)) if wait_for_all else (lambda: 0))

    def _free_evicted(self):
        """On the engine thread: free the state of entries Serve evicted."""
        while self._evicted:
            held = self._evicted.pop()
            if held.request is not None:
                self.counters["num_evicted"] += 1
            self._release(held)

    def _record_load(self):
        """On the engine thread: the load gauges, after every batch and every free."""
        self.metrics.set_load(len(self._held), self.engine.target_cache.num_used)

    def _release(self, held: _Held):
        if self._held.get(held.request_id) is held:
            del self._held[held.request_id]
        if held.request is not None:
            self.engine.release(held.request)
            held.request = None

    def _admit(self, held: _Held, prompt_ids: list[int], params: SamplingParams, tenant=None) -> Request | None:
        """On the engine thread: a fresh mirror for `held` (replacing any), None if the request was freed."""
        self._free_evicted()
        if held.request_id in self._freed:
            return None
        self._release(held)
        old = self._held.get(held.request_id)
        if old is not None:  # an older LRU entry of this id (evicted and loaded again): superseded
            self._release(old)
        held.request = self.engine.add_request(prompt_ids, params, tenant)
        self._held[held.request_id] = held
        return held.request

    def _live(self, held: _Held) -> Request | None:
        """On the engine thread: the mirror, or None when it is gone (evicted, freed, never made)."""
        if self._fault is not None:
            kind, num_calls = self._fault
            self._fault = (kind, num_calls - 1) if num_calls > 1 else None
            if num_calls <= 1:
                if kind == "crash":
                    os._exit(1)
                for other in list(self._held.values()):
                    self._release(other)
        if held.request is None:
            self.counters["num_missing"] += 1
        return held.request

    def _free(self, request_id: str, finished: bool = False):
        self._free_evicted()
        held = self._held.get(request_id)
        if finished and held is not None and held.request is not None:
            held.request.finish_reason = "stop"  # a finished output (not an aborted one) joins the suffix index
        self._freed[request_id] = None
        while len(self._freed) > NUM_FREED_REMEMBERED:
            self._freed.popitem(last=False)
        held = self._held.get(request_id)
        if held is not None:
            self._release(held)
        self._record_load()

    # ---- the API the router calls (and tests) ----

    async def free(self, request_id: str, finished: bool = False):
        """The request finished (`finished`) or left: free its state here."""
        await self._on_engine(self._free, request_id, finished)

    async def slots(self) -> dict:
        def read():
            self._free_evicted()
            return {"used": self.engine.target_cache.num_used, "total": self.num_slots, "running": len(self._held)}

        return await self._on_engine(read)

    async def info(self) -> ReplicaInfo:
        return self._info

    async def stats(self) -> dict:
        return {**self.counters, **self._batches.stats(), **await self.slots()}

    async def check_health(self):
        """Serve's health hook: unhealthy (replaced, shards and placement group anew) when a target shard is gone."""
        await check_shards(self.engine.target)

    async def drop_state_after(self, num_calls: int):
        """Test hook: lose every request's state here at the `num_calls`-th draft/verify call from now,
        as a restarted replica would (the router must re-prefill)."""
        await self._on_engine(setattr, self, "_fault", ("drop", num_calls))

    async def crash_after(self, num_calls: int):
        """Test hook: this replica's process exits in the middle of its `num_calls`-th draft/verify call
        from now, as a crashing replica would (the call fails under the router; Serve starts a new replica)."""
        await self._on_engine(setattr, self, "_fault", ("crash", num_calls))


@dataclass
class SuffixDraft:
    """A drafter mirror's last block when it was a suffix proposal: what the next call's new tokens answer."""

    proposal: Proposal
    width: int  # its drafts that were sent to verification


def pad_rows(rows) -> torch.Tensor | None:
    """Rows of different lengths [n_i] as one [len(rows), max n_i] tensor, zeros after each row (None if any is None)."""
    if any(row is None for row in rows):
        return None
    out = torch.zeros(len(rows), max(len(row) for row in rows))
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


# ---- verifier -----------------------------------------------------------------------------


def build_verifier(config: AppConfig) -> tuple[Engine, ReplicaInfo]:
    """The target and its KV cache (with num_shards > 1: in shard actors, and only the slot bookkeeping
    here); the drafter is loaded only to learn which features it reads."""
    loaded = load_models(config.engine)
    if config.num_shards > 1:
        target, loaded.target = start_shards(config, loaded.dtype), None
    else:
        target = loaded.target
    engine = build_engine(config.engine, loaded, target=target, drafts=False)
    return engine, replica_info(config, loaded, engine)


@serve.deployment(health_check_period_s=HEALTH_CHECK_PERIOD_S)
class VerifierReplica(_MirrorReplica):
    """The target with a KV slot per request: prefill, and verify + accept a drafted block."""

    def __init__(self, config: dict):
        self._start(config, "verifier", build_verifier)
        self._batches = self._batcher(self._verify, wait_for_all=True)  # the dearer pass: make it count

    async def prefill(self, request_id: str, prompt_ids: list[int], output_ids: list[int],
                      params: RequestParams | SamplingParams) -> Prefilled | Lost:
        """Build the request's state from the router's truth. With no output yet: validate the request
        (raises EngineRequestError) and sample the first token. Otherwise rebuild the cache for the
        committed tokens (`params` resolved then); the token sampled is discarded."""
        if isinstance(params, RequestParams):
            params = sampling_params(self.engine, self._info.max_block_size, prompt_ids, params)
        held = await self._hold(request_id)
        return await self._on_engine(self._prefill, held, prompt_ids, output_ids, params)

    @torch.inference_mode()
    def _prefill(self, held, prompt_ids, output_ids, params):
        # the mirror's prompt is everything the target must cache: prompt + output[:-1]
        mirror_params = replace(params, max_tokens=params.max_tokens - max(len(output_ids) - 1, 0))
        r = self._admit(held, prompt_ids + output_ids[:-1], mirror_params)
        if r is None:
            return Lost()
        rebuild = bool(output_ids)
        first = self.engine.prefill([r])[0]
        r.output_ids = output_ids[-1:] if rebuild else first
        features, r.pending_features = r.pending_features, None
        self._record_load()
        return Prefilled(params, [] if rebuild else first, features.clone())

    async def shard_actors(self) -> list:
        """This replica's TargetShard actors (none when the target runs in this process), for fault tests."""
        target = self.engine.target
        return list(target.shards) if isinstance(target, ShardedTarget) else []

    async def verify(self, request_id: str, block_ids: list[int], draft_probs: torch.Tensor | None,
                     proposer: str = "dflash") -> Verified | Lost:
        """Verify one block [last token, drafts...] (draft_probs [b - 1, vocab] for sampling requests) that
        `proposer` drafted (for the metrics)."""
        held = await self._hold(request_id)
        return await self._batches(held, block_ids, draft_probs, proposer)

    @torch.inference_mode()
    def _verify(self, helds, blocks, probs, proposers) -> list[Verified | Lost]:
        self._free_evicted()
        mirrors = [self._live(h) for h in helds]
        rows = sorted((i for i, r in enumerate(mirrors) if r is not None), key=lambda i: mirrors[i].target_slot)
        results = [Lost()] * len(helds)
        if not rows:
            return results
        requests = [mirrors[i] for i in rows]
        block_sizes = [len(blocks[i]) for i in rows]
        b_max = max(block_sizes)
        block_ids = torch.zeros(len(rows), b_max, dtype=torch.long)  # [batch, b_max], padding past each block
        for j, i in enumerate(rows):
            block_ids[j, : block_sizes[j]] = torch.tensor(blocks[i])
        draft_probs = None
        if any(probs[i] is not None for i in rows):
            vocab = next(probs[i] for i in rows if probs[i] is not None).shape[-1]
            draft_probs = torch.zeros(len(rows), b_max - 1, vocab)  # [batch, b_max - 1, vocab]; greedy rows unused
            for j, i in enumerate(rows):
                if probs[i] is not None:
                    draft_probs[j, : block_sizes[j] - 1] = probs[i]
            draft_probs = draft_probs.to(self.engine.device)
        draft = DraftBlock(block_ids.to(self.engine.device), draft_probs, block_sizes,
                           proposers=[proposers[i] for i in rows])
        num_accepted, next_ids, features = self.engine.verify(requests, draft)
        for j, (i, r) in enumerate(zip(rows, requests)):
            self.engine.commit(r, num_accepted[j] + 1, features[j])
            new_features, r.pending_features = r.pending_features, None
            results[i] = Verified(num_accepted[j], next_ids[j][: num_accepted[j] + 1], new_features.clone())
        self._record_load()
        return results


# ---- drafter ------------------------------------------------------------------------------


def build_drafter(config: AppConfig) -> tuple[Engine, ReplicaInfo]:
    """The drafter and the target's embedding and LM head; the rest of the target is loaded, then
    dropped. The block policy is the drafter's: an adaptive one is profiled on the whole target
    here before it is dropped (a colocated step's cost: the hops to the verifier are not in it)."""
    loaded = load_models(config.engine)
    engine = build_engine(config.engine, loaded, target=TargetHead(loaded.target), cost_table_tag=cost_table_tag(config))
    return engine, replica_info(config, loaded, engine)


@serve.deployment(health_check_period_s=HEALTH_CHECK_PERIOD_S)
class DrafterReplica(_MirrorReplica):
    """The drafter with a drafter-KV slot per request: drafts a block from the new context features."""

    def __init__(self, config: dict):
        self._start(config, "drafter", build_drafter)
        self._batches = self._batcher(self._draft, wait_for_all=False)

    async def draft(self, request_id: str, new_token_ids: list[int], features: torch.Tensor,
                    start: DraftStart | None = None) -> Drafted | Lost:
        """Take the tokens committed since the last call and their target features [len, F], and draft
        the next block. `start` (re)creates the state; new_token_ids then are all of the output and
        features cover every position from 0."""
        held = await self._hold(request_id)
        return await self._batches(held, new_token_ids, features, start)

    async def stats(self) -> dict:
        """Also the blocks this replica drafted and how many of their drafts the verifier accepted."""
        return {**await super().stats(), "spec_decoding": await self._on_engine(self.engine.stats.to_dict)}

    @torch.inference_mode()
    def _draft(self, helds, new_ids, features, starts) -> list[Drafted | Lost]:
        self._free_evicted()
        mirrors = []
        for held, start in zip(helds, starts):
            mirrors.append(self._live(held) if start is None else self._admit(held, start.prompt_ids, start.params,
                                                                               start.tenant))
        rows = sorted((i for i, r in enumerate(mirrors) if r is not None), key=lambda i: mirrors[i].draft_slot)
        results = [Lost()] * len(helds)
        if not rows:
            return results
        requests = [mirrors[i] for i in rows]
        answered = [(i, r) for i, r in zip(rows, requests) if starts[i] is None and getattr(r, "last_draft", None)]
        self._observe_answers([(i, r) for i, r in answered if not isinstance(r.last_draft, SuffixDraft)], new_ids)
        by_suffix = [(i, r) for i, r in answered if isinstance(r.last_draft, SuffixDraft)]
        if by_suffix:
            self.engine.observe_suffix([r for _, r in by_suffix], [r.last_draft.proposal for _, r in by_suffix],
                                       [r.last_draft.width for _, r in by_suffix], [len(new_ids[i]) - 1 for i, _ in by_suffix])
        for i, r in zip(rows, requests):
            r.output_ids += new_ids[i]
            if self.engine.suffix is not None:
                self.engine.suffix.extend(r.request_id, new_ids[i])
            self.engine.commit(r, features[i].shape[0], features[i].to(self.engine.device))
        caps = [self.engine.block_cap(r) for r in requests]
        proposals = self.engine.suffix_proposals(requests, caps)
        widths = self.engine.policy.suffix_widths(requests, caps, proposals) if any(proposals) else [0] * len(requests)
        by_drafter = [j for j, w in enumerate(widths) if w == 0]
        drafting = [requests[j] for j in by_drafter]
        block_sizes = self.engine.policy.choose(drafting, [caps[j] for j in by_drafter])
        drafted = self.engine.draft(drafting, block_sizes) if drafting else None
        draft = self.engine.with_suffix(requests, by_drafter, self.engine.trim(drafting, drafted) if drafting else None,
                                        proposals, widths)
        for j, (i, r) in enumerate(zip(rows, requests)):
            b = draft.block_sizes[j]
            if widths[j]:
                r.last_draft = SuffixDraft(proposals[j], widths[j])  # what the next call's new tokens answer
            else:
                k = by_drafter.index(j)
                confidence = None if drafted.confidence is None else drafted.confidence[k, : block_sizes[k] - 1].cpu()
                r.last_draft = (block_sizes[k], b, confidence)
            probs = None
            if draft.draft_probs is not None and r.params.temperature > 0:
                probs = draft.draft_probs[j, : b - 1].float().cpu().clone()
            results[i] = Drafted(draft.block_ids[j, :b].tolist(), probs, "suffix" if widths[j] else "dflash")
        self._record_load()
        return results

    def _observe_answers(self, answered, new_ids):
        """The verifier kept all but the bonus token of each request's last drafter block."""
        if answered:
            drafted_sizes, verified_sizes, confidence = zip(*(r.last_draft for _, r in answered))
            last = DraftBlock(None, None, list(drafted_sizes), pad_rows(confidence))
            self.engine.observe([r for _, r in answered], last, list(verified_sizes),
                                [len(new_ids[i]) - 1 for i, _ in answered])


# ---- router -------------------------------------------------------------------------------


def _replica_died(e: Exception) -> bool:
    """A call failed because its replica died or is unreachable (Serve raises Ray's ActorDiedError or
    ActorUnavailableError) or because a target shard under the replica died (the replica's error, caused by one)."""
    return isinstance(e, RayActorError) or isinstance(getattr(e, "cause", None), RayActorError)


async def _result(response):
    return await response


class _Recovery:
    """One step's way back to replica state: at most MAX_REBUILDS_PER_STEP rebuilds when live replicas
    lost it, and, once a replica died under a call, retries with growing pauses until `deadline`
    (REPLICA_RECOVERY_S later), by when Serve must route to a healthy (restarted or other) replica."""

    def __init__(self):
        self.num_rebuilds, self.num_failures, self.deadline, self.first_failure = 0, 0, None, None

    async def before_retry(self, lost: Lost):
        """Before the next try after `lost`; raises when out of tries or time."""
        if lost.died is None:
            self.num_rebuilds += 1
            if self.num_rebuilds > MAX_REBUILDS_PER_STEP:
                raise RuntimeError(f"the {lost.role} kept losing this request's state")
            return
        if self.deadline is None:
            self.deadline, self.first_failure = time.monotonic() + REPLICA_RECOVERY_S, lost
        if time.monotonic() >= self.deadline:
            first = self.first_failure
            raise EngineRequestError(f"a {first.role} replica failed under this request ({first.died}) and no "
                                     f"healthy one answered within {REPLICA_RECOVERY_S} s; retry later", 503)
        first, longest = RETRY_BACKOFF_S
        await asyncio.sleep(min(first * 2 ** self.num_failures, longest))
        self.num_failures += 1


@serve.deployment
class Router:
    """Owns each request's prompt, committed tokens and random-stream states (the durable truth) and
    runs its loop: verifier.prefill -> {drafter.draft -> verifier.verify -> commit -> stream}. Streams
    the same chunks as EngineReplica.generate, so the OpenAI ingress serves either topology. State a
    replica lost, or a replica that died under a call, is rebuilt by re-prefilling from that truth."""

    def __init__(self, drafter: DeploymentHandle, verifier: DeploymentHandle, config: dict):
        self.drafter, self.verifier = drafter, verifier
        self.config = AppConfig.model_validate(config)
        num_verifiers = (self.config.autoscaling_config or {}).get("max_replicas", self.config.num_replicas)
        # requests decoding at once; more would evict each other's state in the replicas' LRUs
        self._admission = asyncio.Semaphore(self.config.engine.max_slots * num_verifiers)
        self._num_waiting = 0  # requests waiting for admission; at most max_queued_requests (unless -1)
        self._info: ReplicaInfo | None = None
        self._frees: set[asyncio.Task] = set()
        self.counters = dict.fromkeys(("num_requests", "num_finished", "num_cancelled", "num_failed",
                                       "num_rebuilds", "num_replica_failures", "num_generated_tokens"), 0)
        self._failure_causes: Counter[str] = Counter()  # exception type name -> failed replica calls
        self._num_active = 0
        self._active_gauge = active_requests_gauge(self.config.model_name, self.config.topology)

    async def generate(self, prompt_ids: list[int], params: RequestParams):
        """Stream one request as Chunks. Closing the stream stops the request and frees its state in both
        replicas."""
        info = await self.info()
        request_id = uuid.uuid4().hex
        verifier = self.verifier.options(multiplexed_model_id=request_id)
        drafter = self.drafter.options(multiplexed_model_id=request_id)
        self.counters["num_requests"] += 1
        done, r = False, None
        async with self._admitted():
            self._set_active(+1)
            try:
                try:
                    out = await self._first_prefill(verifier, request_id, list(prompt_ids), params)
                except EngineRequestError:  # a request the verifier rejects: the client's error, by its status
                    done = True
                    raise
                r = Request(0, list(prompt_ids), out.params, tenant=params.tenant)
                stop_ids = info.stop_token_ids
                r.append_output(out.token_ids, stop_ids, speculative=False)
                new_ids, features = out.token_ids, out.features
                start = DraftStart(r.prompt_ids, r.params, params.tenant)
                yield self._chunk(r, out.token_ids)
                while not r.finished:
                    drafted = await self._call("drafter", drafter.draft, request_id, new_ids, features, start)
                    recovery = _Recovery()
                    while isinstance(drafted, Lost):
                        await recovery.before_retry(drafted)
                        drafted = await self._redraft(verifier, drafter, request_id, r, recovery.deadline)
                    start = None
                    block_ids, draft_probs = drafted.block_ids, drafted.draft_probs
                    verified = await self._call("verifier", verifier.verify, request_id, block_ids, draft_probs,
                                                drafted.proposer)
                    recovery = _Recovery()
                    while isinstance(verified, Lost):
                        await recovery.before_retry(verified)
                        verified = await self._rebuild_verifier(verifier, request_id, r, recovery.deadline)
                        if not isinstance(verified, Lost):
                            verified = await self._call("verifier", verifier.verify, request_id, block_ids,
                                                        draft_probs, drafted.proposer, deadline=recovery.deadline)
                    r.stats.observe_draft(len(block_ids) - 1, verified.num_accepted, drafted.proposer)
                    new_ids, features = verified.token_ids, verified.features
                    yield self._chunk(r, r.append_output(new_ids, stop_ids))
                done = True
                self.counters["num_finished"] += 1
            except Exception:
                self.counters["num_failed"] += 1
                raise
            finally:
                if not done:
                    self.counters["num_cancelled"] += 1
                self._free_later(request_id, finished=done and r is not None and r.finished)
                self._set_active(-1)

    @contextlib.asynccontextmanager
    async def _admitted(self):
        """Hold one of the decoding places; 503 when max_queued_requests requests already wait for one."""
        limit = self.config.max_queued_requests
        if self._admission.locked() and 0 <= limit <= self._num_waiting:
            raise EngineRequestError(f"the server is overloaded ({self._num_waiting} requests wait for a decoding "
                                     f"slot); retry later", 503)
        self._num_waiting += 1
        try:
            await self._admission.acquire()
        finally:
            self._num_waiting -= 1
        try:
            yield
        finally:
            self._admission.release()

    def _set_active(self, change: int):
        self._num_active += change
        self._active_gauge.set(self._num_active)

    async def _call(self, role: str, method, *args, deadline: float | None = None):
        """One call to a drafter or verifier replica: its answer, or Lost (with the role) when the replica
        had no state, died under the call (or a target shard under it did) or did not answer by
        `deadline` (time.monotonic())."""
        response = method.remote(*args)
        try:
            if deadline is None:
                out = await response
            else:
                out = await asyncio.wait_for(_result(response), max(deadline - time.monotonic(), 0.0))
            return replace(out, role=role) if isinstance(out, Lost) else out
        except TimeoutError:
            response.cancel()
            why = "no answer in time"
        except Exception as e:
            cause = getattr(e, "cause", e)
            if isinstance(cause, EngineRequestError):  # Serve wraps the replica's error: re-raise it as is
                raise EngineRequestError(cause.message, cause.status_code) from None
            if not _replica_died(e):
                raise
            why = type(e).__name__  # e.g. ActorDiedError; RayTaskError(ActorDiedError) for a lost shard
        self.counters["num_replica_failures"] += 1
        self._failure_causes[why] += 1
        logger.warning("a %s call failed (%s): recovering from the committed tokens", role, why)
        return Lost(role, why)

    async def _first_prefill(self, verifier, request_id: str, prompt_ids: list[int], params: RequestParams) -> Prefilled:
        """The verifier's first prefill (validates the request, samples the first token); retried when
        the verifier replica dies under it."""
        recovery = _Recovery()
        out = await self._call("verifier", verifier.prefill, request_id, prompt_ids, [], params)
        while isinstance(out, Lost) and out.died is not None:
            await recovery.before_retry(out)
            out = await self._call("verifier", verifier.prefill, request_id, prompt_ids, [], params,
                                   deadline=recovery.deadline)
        if isinstance(out, Lost):
            raise RuntimeError("the verifier had already freed this request")
        return out

    async def _rebuild_verifier(self, verifier, request_id: str, r: Request, deadline: float | None) -> Prefilled | Lost:
        """Re-prefill the verifier from the committed tokens (the features of every position), or Lost."""
        self.counters["num_rebuilds"] += 1
        out = await self._call("verifier", verifier.prefill, request_id, r.prompt_ids, r.output_ids, r.params,
                               deadline=deadline)
        if isinstance(out, Lost) and out.died is None:
            raise RuntimeError("the verifier refused to rebuild this request's state")
        return out

    async def _redraft(self, verifier, drafter, request_id: str, r: Request, deadline: float | None) -> Drafted | Lost:
        """The drafter lost the state: re-prefill the verifier to get every position's features, recreate
        the drafter's state from them and draft. The draft, or what was lost."""
        rebuilt = await self._rebuild_verifier(verifier, request_id, r, deadline)
        if isinstance(rebuilt, Lost):
            return rebuilt
        start = DraftStart(r.prompt_ids, r.params, r.tenant)
        return await self._call("drafter", drafter.draft, request_id, r.output_ids, rebuilt.features, start,
                                deadline=deadline)

    def _chunk(self, r: Request, new_ids: list[int]) -> Chunk:
        self.counters["num_generated_tokens"] += len(new_ids)
        return Chunk(new_ids, r.finish_reason, r.stats.to_dict())

    def _free_later(self, request_id: str, finished: bool = False):
        """Free the request in both replicas without blocking (this may run while being cancelled)."""
        async def free():
            await asyncio.gather(self.drafter.options(multiplexed_model_id=request_id).free.remote(request_id, finished),
                                 self.verifier.options(multiplexed_model_id=request_id).free.remote(request_id),
                                 return_exceptions=True)

        # a fresh context: Serve cancels the calls a cancelled request made, and this one's context is cancelled
        task = asyncio.get_running_loop().create_task(free(), context=contextvars.Context())
        self._frees.add(task)
        task.add_done_callback(self._frees.discard)

    async def info(self) -> ReplicaInfo:
        if self._info is None:
            self._info = await self.verifier.info.remote()
        return self._info

    async def slots(self) -> dict:
        """KV slots in use in a verifier and a drafter replica, and requests in flight here."""
        verifier, drafter = await asyncio.gather(self.verifier.slots.remote(), self.drafter.slots.remote())
        return {"used": verifier["used"], "total": verifier["total"], "drafter": drafter, "verifier": verifier}

    async def health(self) -> dict:
        return {"status": "ok", **await self.slots()}

    async def stats(self) -> dict:
        """The counters, replica failures by exception type, and slots()."""
        return {**self.counters, "replica_failure_causes": dict(self._failure_causes), **await self.slots()}

    async def wait_for_frees(self):
        """Until every queued free has reached both replicas (tests)."""
        start = time.monotonic()
        while self._frees and time.monotonic() - start < 10:
            await asyncio.sleep(0.02)
