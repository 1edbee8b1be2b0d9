"""One engine replica (colocated topology): drafter and target in one process, one Engine, streamed.

It owns the engine, the single thread every engine call runs on, the step loop and one token
stream per request; it knows nothing about HTTP, text or tokenizers (token ids in, token ids out).
Invariant: every request is in exactly one of `_waiting` (not yet admitted), `_running` (holds
KV slots, keyed by engine request id) or neither (finished, failed or cancelled, slots freed or
about to be freed by the next step's aborts).
"""

import asyncio
import ctypes
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields

import torch
from ray import serve

from deployments.config import AppConfig
from deployments.metrics import EngineMetrics
from deployments.records import Chunk, ReplicaInfo, RequestParams
from deployments.shards import check_shards, start_shards
from engine.config import build_engine, load_models
from engine.engine import Engine, Request, SamplingParams
from engine.loading import Loaded
from engine.model import TargetHead
from engine.runtime import cap_matmul_caches

logger = logging.getLogger("ray.serve")


class EngineRequestError(Exception):
    """A request the engine cannot run: the client's fault (400) or, with 503, the replica is full."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message, status_code)
        self.message, self.status_code = message, status_code

    def __str__(self):
        return self.message


def cost_table_tag(config: AppConfig) -> str:
    """How the replica runs the target, as far as it changes the adaptive policy's step costs."""
    shards = f"-s{config.num_shards}x{config.shard_num_cpus:g}" if config.num_shards > 1 else ""
    return shards + ("-disagg" if config.topology == "disaggregated" else "")


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc
        return None


LIBC = _libc()
M_ARENA_MAX = -8  # glibc's mallopt parameter
TRIM_EVERY_STEPS = 1000  # engine steps between heap trims under unbroken load


def tune_malloc():
    """At most 2 glibc malloc arenas: each thread that allocates may otherwise get its own (up to 8 per
    core), and tensors freed by another thread than the one that made them fragment them. (Not a fixed
    mmap threshold: blocks over it are mapped afresh at every use, and the page faults slow steps down.)"""
    if LIBC is not None:
        LIBC.mallopt(M_ARENA_MAX, 2)


def release_free_memory():
    """Hand the heap's free pages back to the OS (glibc malloc_trim); the step loop calls it when idle."""
    if LIBC is not None:
        LIBC.malloc_trim(0)


def start_engine(config: AppConfig, threads: int, build):
    """The engine thread of a replica: `build(config)` runs on it, and so does every later step.
    Returns (executor, engine, info, metrics) with the engine's forwards instrumented."""
    cap_matmul_caches()
    tune_malloc()
    torch.set_num_threads(threads)  # more threads than reserved CPUs: OpenMP spin-waits starve everyone
    executor = ThreadPoolExecutor(1, thread_name_prefix="engine", initializer=torch.set_num_threads, initargs=(threads,))
    engine, info = executor.submit(build, config).result()
    metrics = EngineMetrics(config.model_name, config.topology)
    metrics.instrument(engine)
    return executor, engine, info, metrics


def replica_info(config: AppConfig, loaded: Loaded, engine: Engine) -> ReplicaInfo:
    """What a replica built from `config` and `loaded` serves (read on the engine's thread)."""
    return ReplicaInfo(
        model=config.model_name, target=str(loaded.target_path), drafter=loaded.drafter_name,
        dtype=str(loaded.dtype).removeprefix("torch."), device=config.engine.device,
        policy=config.engine.policy if loaded.drafter is not None else "none",
        max_block_size=config.engine.max_block_size(loaded.drafter), max_slots=engine.target_cache.num_slots,
        max_len=engine.max_len, torch_threads=torch.get_num_threads(), num_shards=config.num_shards,
        topology=config.topology, stop_token_ids=engine.stop_token_ids,
    )


def build_colocated(config: AppConfig) -> tuple[Engine, ReplicaInfo]:
    """The engine with drafter and target in this process (the target's layers in shard actors when
    num_shards > 1: the drafter still needs its embedding and LM head here)."""
    loaded = load_models(config.engine)
    target = None
    if config.num_shards > 1:
        target = start_shards(config, loaded.dtype, head=TargetHead(loaded.target))
        loaded.target = None
    engine = build_engine(config.engine, loaded, target=target, cost_table_tag=cost_table_tag(config))
    return engine, replica_info(config, loaded, engine)


def sampling_params(engine: Engine, max_block_size: int, prompt_ids: list[int], params: RequestParams) -> SamplingParams:
    """The engine's SamplingParams, checked now (Engine.check_request) so a bad request fails at
    once even when it would have to wait for a slot."""
    given = {k: v for k, v in asdict(params).items() if v is not None}
    if "stop_token_ids" in given:
        given["stop_token_ids"] = tuple(given["stop_token_ids"])
    max_len, num_prompt = engine.max_len, len(prompt_ids)
    if "max_tokens" not in given:
        if num_prompt >= max_len:
            raise EngineRequestError(
                f"the prompt has {num_prompt} tokens, but this model's context length is {max_len} tokens "
                f"(prompt + completion)")
        given["max_tokens"] = max_len - num_prompt
    block = given.setdefault("block_size", max_block_size)
    if isinstance(block, int) and block > max_block_size:
        raise EngineRequestError(f"block_size must be <= {max_block_size} (this server's largest "
                                 f"block), got {block}")
    sampling = SamplingParams(**{f.name: given[f.name] for f in fields(SamplingParams) if f.name in given})
    try:
        engine.check_request(prompt_ids, sampling)
    except ValueError as e:
        raise EngineRequestError(str(e)) from None
    return sampling


@dataclass
class _Stream:
    """One request's path from the step loop to its `generate` caller."""

    prompt_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue  # (new token ids, finish reason, stats dict) tuples, or an exception to raise
    request: Request | None = None  # set on the engine thread when admitted
    cancelled: bool = False
    tenant: str | None = None  # RequestParams.tenant


@serve.deployment
class EngineReplica:
    def __init__(self, config: dict):
        self.config = AppConfig.model_validate(config)
        self._executor, self.engine, self._info, self.metrics = start_engine(
            self.config, self.config.torch_threads, build_colocated)
        self.num_slots = self.engine.target_cache.num_slots
        self.max_waiting = self.config.replica_max_ongoing_requests
        self._waiting: deque[_Stream] = deque()
        self._running: dict[int, _Stream] = {}
        self._aborts: list[int] = []
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._consecutive_failures = 0
        self._num_steps = 0
        self.counters = dict.fromkeys(
            ("num_requests", "num_finished", "num_cancelled", "num_rejected", "num_failed", "num_prompt_tokens",
             "num_generated_tokens"), 0)
        logger.info("engine replica ready: %s", self._info)

    # ---- the API the ingress calls ------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: RequestParams):
        """Stream one request: a Chunk as tokens are committed. Closing the stream aborts the request."""
        self._ensure_step_loop()
        sampling = self._sampling_params(prompt_ids, params)
        if len(self._waiting) >= self.max_waiting:
            self.counters["num_rejected"] += 1
            raise EngineRequestError(f"the replica is overloaded ({len(self._waiting)} requests queued)", 503)
        stream = _Stream(list(prompt_ids), sampling, asyncio.Queue(), tenant=params.tenant)
        self.counters["num_requests"] += 1
        self.counters["num_prompt_tokens"] += len(prompt_ids)
        self._waiting.append(stream)
        self._wake.set()
        done = False
        try:
            while not done:
                token_ids, finish_reason, stats = await self._next(stream)
                while finish_reason is None and not stream.queue.empty():  # a slow reader gets one merged chunk
                    more, finish_reason, stats = await self._next(stream)
                    token_ids = token_ids + more
                done = finish_reason is not None
                yield Chunk(token_ids, finish_reason, stats)
        finally:
            if not done:  # client gone (CancelledError / GeneratorExit) or an error: free the slots
                self._cancel(stream)

    async def slots(self) -> dict:
        """KV-cache slots in use (read on the engine thread) and requests waiting for one."""
        used = await asyncio.get_running_loop().run_in_executor(self._executor, lambda: self.engine.target_cache.num_used)
        return {"used": used, "total": self.num_slots, "running": len(self._running), "waiting": len(self._waiting)}

    async def health(self) -> dict:
        """Also the tokens the suffix proposer's shared index holds (bounded by suffix_index_tokens)."""
        await self.check_health()
        suffix = self.engine.suffix
        return {"status": "ok", **await self.slots(),
                **({} if suffix is None else {"suffix_index_tokens": suffix.global_index.num_tokens})}

    async def info(self) -> ReplicaInfo:
        return self._info

    async def stats(self) -> dict:
        """This replica's totals: request counters and the engine's speculative statistics."""
        spec = await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.stats.to_dict)
        overhead = getattr(self.engine.policy, "overhead", None)  # the adaptive policy's estimate
        return {**self.counters, "spec_decoding": spec, **await self.slots(),
                **({} if overhead is None else {"step_overhead_ms": round(1e3 * overhead, 2)})}

    async def check_health(self):
        """Serve's health hook: unhealthy (and restarted) when the step loop died or keeps failing, or a
        target shard is gone."""
        task = self._loop_task
        if task is not None and task.done():
            raise RuntimeError(f"the engine step loop stopped: {'cancelled' if task.cancelled() else repr(task.exception())}")
        if self._consecutive_failures >= 3:
            raise RuntimeError(f"the last {self._consecutive_failures} engine steps failed")
        await check_shards(self.engine.target)

    # ---- validation ---------------------------------------------------------------------

    def _sampling_params(self, prompt_ids: list[int], params: RequestParams) -> SamplingParams:
        return sampling_params(self.engine, self._info.max_block_size, prompt_ids, params)

    # ---- the step loop ------------------------------------------------------------------

    async def _next(self, stream: _Stream):
        item = await stream.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _cancel(self, stream: _Stream):
        """Stop a request from any state; its slots are freed by the next step's aborts."""
        stream.cancelled = True
        if stream in self._waiting:
            self._waiting.remove(stream)
            self.counters["num_cancelled"] += 1
        elif stream.request is not None and self._running.pop(stream.request.request_id, None) is not None:
            self._aborts.append(stream.request.request_id)
            self.counters["num_cancelled"] += 1
            self._wake.set()
        # else: finished, failed, or being admitted right now (the step loop aborts it on return)

    def _ensure_step_loop(self):
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    async def _step_loop(self):
        """Step the engine while anything is waiting, running or to abort; sleep otherwise."""
        loop = asyncio.get_running_loop()
        while True:
            if not (self._waiting or self._running or self._aborts):
                self._wake.clear()
                await loop.run_in_executor(self._executor, release_free_memory)
                if not self._wake.is_set():
                    await self._wake.wait()
                continue
            aborts, self._aborts = self._aborts, []
            admit = [self._waiting.popleft() for _ in range(min(len(self._waiting), self.num_slots - len(self._running)))]
            try:
                rejected, outputs = await loop.run_in_executor(self._executor, self._engine_step, admit, aborts)
            except Exception as e:  # an engine bug: fail what it was running, keep serving the rest
                logger.exception("engine step failed")
                self._consecutive_failures += 1
                self._fail([*admit, *self._running.values()], e)
                continue
            self._consecutive_failures = 0
            for stream, error in rejected:
                self.counters["num_rejected"] += 1
                stream.queue.put_nowait(EngineRequestError(str(error)))
            for stream in admit:
                if stream.request is None:
                    continue
                if stream.cancelled:  # cancelled while being admitted
                    self._aborts.append(stream.request.request_id)
                    self.counters["num_cancelled"] += 1
                else:
                    self._running[stream.request.request_id] = stream
            for out in outputs:
                stream = self._running.get(out.request_id)
                if stream is None:
                    continue
                self.counters["num_generated_tokens"] += len(out.new_token_ids)
                stats = {**stream.request.stats.to_dict(), "cached_prompt_tokens": stream.request.num_prefix_cached}
                stream.queue.put_nowait((out.new_token_ids, out.finish_reason, stats))
                if out.finish_reason is not None:
                    self.counters["num_finished"] += 1
                    del self._running[out.request_id]

    def _engine_step(self, admit: list[_Stream], aborts: list[int]):
        """On the engine thread: abort, admit, then one engine step -> (rejected, step outputs)."""
        for request_id in aborts:
            self.engine.abort(request_id)
        rejected = []
        for stream in admit:
            try:
                stream.request = self.engine.add_request(stream.prompt_ids, stream.params, stream.tenant)
            except ValueError as e:
                rejected.append((stream, e))
        outputs = self.engine.step() if self.engine.num_running else []
        self._num_steps += 1
        if self._num_steps % TRIM_EVERY_STEPS == 0:  # a replica that is never idle trims too
            release_free_memory()
        self.metrics.set_load(self.engine.num_running, self.engine.target_cache.num_used)
        return rejected, outputs

    def _fail(self, streams: list[_Stream], error: Exception):
        for stream in streams:
            if stream.request is not None:
                self._aborts.append(stream.request.request_id)
            stream.queue.put_nowait(RuntimeError(f"the engine failed on this request: {error!r}"))
        self.counters["num_failed"] += len(streams)
        self._running.clear()

