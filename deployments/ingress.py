"""The OpenAI-compatible HTTP front (FastAPI on Ray Serve): /v1/chat/completions, /v1/completions,
/v1/models, /health, with SSE streaming and OpenAI-shaped errors, API keys and request size limits.

It owns requests as text: validation, the chat template, tokenization, incremental detokenization,
stop strings and usage. It knows nothing about decoding: token ids go to an engine replica through
a streaming DeploymentHandle and committed token ids come back.
"""

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.config import AppConfig, env_api_keys
from deployments.engine_replica import EngineRequestError
from deployments.metrics import RequestMetrics
from deployments.records import Chunk, ReplicaInfo, RequestParams
from engine.default_model import resolve_model_path

# ---- errors -----------------------------------------------------------------------------

RETRY_AFTER_S = 1  # what an overloaded server (503) tells clients to wait before retrying


class APIError(Exception):
    """An error answered as OpenAI's {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code
        self.type = type or ("invalid_request_error" if status_code < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status_code in (429, 503) else \
            {"WWW-Authenticate": "Bearer"} if self.status_code == 401 else None
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def from_replica_error(e: Exception) -> APIError:
    """An exception raised by the engine replica (Serve re-raises it wrapped) as an APIError."""
    cause = getattr(e, "cause", e)
    if isinstance(cause, EngineRequestError):
        return APIError(cause.status_code, cause.message, code="overloaded" if cause.status_code == 503 else None)
    if isinstance(cause, BackPressureError):
        return APIError(503, "the server is overloaded (every engine replica's queue is full); retry later",
                        code="overloaded")
    return APIError(500, f"the engine failed: {type(cause).__name__}: {cause}")


def describe_validation_error(error: dict) -> tuple[str, str | None]:
    """One pydantic/FastAPI error as (readable message naming the field, param)."""
    if error.get("type") == "json_invalid":
        return f"invalid JSON body: {error.get('ctx', {}).get('error', 'could not parse it')}", None
    if error.get("type") == "missing" and tuple(error.get("loc", ())) == ("body",):
        return "the request body is missing: send a JSON object", None
    if isinstance(error.get("input"), bytes):  # FastAPI parses JSON only when the Content-Type says so
        return "the request body must be JSON, sent with the header 'Content-Type: application/json'", None
    loc = [str(x) for x in error.get("loc", ()) if x != "body"]
    # drop union-member tags ("str", "list[int]") that pydantic puts into the location
    loc = [x for x in loc if not (x.startswith(("list[", "function-")) or x in ("str", "int", "float", "bool"))]
    field = ".".join(loc) or None
    message = error.get("msg", "invalid value").removeprefix("Value error, ")
    value = error.get("input")
    if error.get("type") not in ("missing", "value_error") and isinstance(value, (str, int, float, bool)) \
            and len(repr(value)) <= 60:
        message += f" (got {value!r})"
    return (f"{field}: {message}" if field else f"request body: {message}"), field


api = FastAPI(title="dflash-serve", description="OpenAI-compatible API over DFlash speculative decoding")


def authorization_error(header: str | None, keys: list[str]) -> APIError | None:
    """None if the Authorization header carries one of `keys` (or no keys are set); never echoes the key."""
    if not keys:
        return None
    scheme, _, key = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return APIError(401, "no API key: send it in the header 'Authorization: Bearer YOUR_KEY'",
                        code="missing_api_key")
    given = key.strip().encode()
    if not any([hmac.compare_digest(given, k.encode()) for k in keys]):  # a list: compare with every key
        return APIError(401, "the API key is not valid", code="invalid_api_key")
    return None


class RequestGuard:
    """ASGI middleware in front of every route: the API key on all but /health (401), then the body size
    limit (413; the body is read here, at most max_request_bytes of it, and replayed to the route).
    Its settings are the app's state, set by the ingress replica: api.state.api_keys, .max_request_bytes."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope["app"].state
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"].removeprefix(scope.get("root_path", ""))  # the route, without Serve's route_prefix
        error = None if path == "/health" else \
            authorization_error(headers.get("authorization"), getattr(state, "api_keys", []))
        limit = getattr(state, "max_request_bytes", AppConfig.model_fields["max_request_bytes"].default)
        too_large = APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                             code="request_too_large")
        length = headers.get("content-length", "")
        if error is None and length.isdigit() and int(length) > limit:
            error = too_large
        if error is not None:
            return await error.response()(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await too_large.response()(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, when the client leaves
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


api.add_middleware(RequestGuard)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    message, param = describe_validation_error(exc.errors()[0])
    return APIError(400, message, param).response()


@api.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError):
    return exc.response()


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI could not decode it
        return APIError(400, f"invalid JSON body: {exc.__cause__}").response()
    return APIError(exc.status_code, str(exc.detail)).response()


@api.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception):
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


# ---- request and response models ------------------------------------------------------------

# Accepted only at the value that means "off": anything else is answered 400, never silently ignored.
NEUTRAL_VALUES = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "logprobs": (False, 0),
    "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none",),
    "best_of": (1,), "echo": (False,), "suffix": ("",), "response_format": ({"type": "text"},),
}


MAX_STOPS = 16  # stop strings per request (each is searched for in the text after every step)
MAX_STOP_CHARS = 256
GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (as in vLLM): 1/T would overflow the logits


def check_text(value, field: str):
    """Text must encode as UTF-8: JSON's escapes can carry lone surrogates (\\ud800) that no tokenizer takes."""
    for text in [value] if isinstance(value, str) else value:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{field} is not valid Unicode (it holds a lone surrogate)") from None
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by both endpoints; OpenAI's names, plus the extensions top_k and block_size. Strict
    types: a string is not a number, nor a number a string."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False,
                               description=f"0 to 2 (OpenAI's range); 0 (or below {GREEDY_BELOW:g}) decodes greedily")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=2**31 - 1,
                       description="extension: sample among the k likeliest tokens; 0 disables it")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = Field(None, validate_default=True, description=f"up to {MAX_STOPS} strings")
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    block_size: int | None = Field(None, ge=1, description="extension: largest block verified per step")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings are supported, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return check_text(stops, "stop")

    def check_supported(self):
        for name, value in (self.model_extra or {}).items():
            if name in NEUTRAL_VALUES and value is not None and value not in NEUTRAL_VALUES[name]:
                raise APIError(400, f"{name} is not supported by this server", param=name)

    def sampling_params(self, max_tokens: int | None) -> RequestParams:
        temperature = 0.0 if self.temperature < GREEDY_BELOW else self.temperature
        return RequestParams(max_tokens=max_tokens, temperature=temperature, top_p=self.top_p, top_k=self.top_k,
                             seed=self.seed, block_size=self.block_size)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    @field_validator("content")
    @classmethod
    def _unicode(cls, v):
        check_text([v] if isinstance(v, str) else [p.text for p in v], "content")
        return v

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"only one prompt per request is supported, got {len(v)}")
            v = v[0]
        if len(v) == 0:
            raise ValueError("the prompt is empty")
        return check_text(v, "prompt")


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


# What the OpenAPI schema (/openapi.json) promises: OpenAI-shaped errors, and JSON or SSE from the generators.
ERRORS = {
    "4XX": {"model": ErrorResponse, "description": "a bad request, a missing or wrong API key (401), an unknown "
            "model (404), a body over the size limit (413)"},
    "5XX": {"model": ErrorResponse, "description": "overloaded (503, with Retry-After), timed out (504) or failed"},
}
GENERATED = {200: {"description": "the completion (JSON), or with stream=true its chunks as server-sent events",
                   "content": {"text/event-stream": {"schema": {  # one event
                       "type": "object", "required": ["data"], "properties": {"data": {
                           "type": "string", "description": "a JSON chunk, a JSON error, or [DONE] at the end"}}}}}},
            **ERRORS}


# ---- text from a token stream ---------------------------------------------------------------


class IncrementalText:
    """The output text of a growing token list, released as deltas that are never broken UTF-8 and
    never part of a stop string: the whole output is decoded each time; a delta is released when
    the text does not end in U+FFFD, less any tail that could still grow into a stop string."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of self.text already released
        self.stopped = False

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int]) -> str:
        start = len(self.ids)
        self.ids += token_ids
        text = self.decode(self.ids)
        cut = self._find_stop(text)
        if cut is not None:
            self.stopped = True
            self.ids = self.ids[: self._tokens_to_stop(start)]
            self.text = text[:cut]
            return self._release(cut)
        self.text = text
        if text.endswith("\ufffd"):  # a character still split across tokens
            return ""
        return self._release(len(text) - self._stop_prefix_len(text))

    def flush(self) -> str:
        """Everything not yet released (at the end of the output)."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def _find_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s, self.sent) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _tokens_to_stop(self, start: int) -> int:
        """The fewest output tokens whose text already contains a stop string (for usage)."""
        for n in range(start + 1, len(self.ids)):
            if self._find_stop(self.decode(self.ids[:n])) is not None:
                return n
        return len(self.ids)

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text) - self.sent), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest


def usage(num_prompt_tokens: int, num_completion_tokens: int, stats: dict | None) -> dict:
    stats = stats or {}
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        # prompt positions reused from another request's cache, not prefilled (OpenAI's field)
        "prompt_tokens_details": {"cached_tokens": stats.get("cached_prompt_tokens", 0)},
        "spec_decoding": {
            "num_drafts": stats.get("num_drafts", 0),
            "num_draft_tokens": stats.get("num_draft_tokens", 0),
            "num_accepted_tokens": stats.get("num_accepted_tokens", 0),
            "mean_acceptance_length": stats.get("mean_acceptance_length", 1.0),
            "acceptance_rate": stats.get("acceptance_rate", 0.0),
            "block_sizes": {str(b): n for b, n in stats.get("block_sizes", {}).items()},
            # per draft source: "dflash" (the drafter), "suffix" (what the context already said)
            "proposers": {name: {key: p.get(key, 0) for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
                          for name, p in stats.get("proposers", {}).items()},
        },
    }


class Generation:
    """One request's run on an engine replica, as text deltas; cancels the replica stream on close.
    Records the request's latencies and tokens in `metrics` as its chunks arrive."""

    def __init__(self, handle: DeploymentHandle, tokenizer, prompt_ids: list[int], params: RequestParams, stops: list[str],
                 timeout_s: float | None, metrics: RequestMetrics):
        self.metrics = metrics
        self.start = time.monotonic()
        self.num_prompt_tokens = len(prompt_ids)
        self.text = IncrementalText(tokenizer, stops)
        self.stats: dict | None = None
        self.finish_reason: str | None = None
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._response = handle.options(stream=True).generate.remote(prompt_ids, params)

    async def deltas(self) -> AsyncIterator[str]:
        """Text deltas; `finish_reason` is set before the last one. Raises APIError on failure."""
        last = None
        try:
            while self.finish_reason is None:
                chunk = await self._next_chunk()
                now = time.monotonic()
                self.metrics.observe_chunk(len(chunk.token_ids), now - self.start, None if last is None else now - last)
                if last is None:
                    self.metrics.observe_prompt(self.num_prompt_tokens, (chunk.stats or {}).get("cached_prompt_tokens", 0))
                last = now
                self.stats = chunk.stats
                delta = self.text.add(chunk.token_ids)
                if self.text.stopped:
                    self.finish_reason = "stop"
                elif chunk.finish_reason is not None:
                    self.finish_reason = "length" if chunk.finish_reason == "length" else "stop"
                    delta += self.text.flush()
                if self.finish_reason is not None:
                    self.metrics.observe_finished(self.finish_reason, now - self.start)
                if delta or self.finish_reason is not None:
                    yield delta
        finally:
            if self.finish_reason is None:  # an error, a timeout or the client left
                self.metrics.observe_finished("abort", None)
            if self.finish_reason is None or self.text.stopped:  # left early, or a stop string: stop the replica
                self._cancel()

    def _cancel(self):
        try:
            self._response.cancel()
        except Exception:  # the call never reached a replica (e.g. BackPressureError): nothing to cancel
            pass

    async def _next_chunk(self) -> Chunk:
        remaining = None if self.deadline is None else max(self.deadline - time.monotonic(), 0)
        try:
            return await asyncio.wait_for(self._response.__anext__(), remaining)
        except StopAsyncIteration:
            raise APIError(500, "the engine ended the stream without a finish reason") from None
        except asyncio.TimeoutError:
            raise APIError(504, f"the request did not finish within {self.timeout_s:g} s", code="timeout") from None
        except (APIError, asyncio.CancelledError):
            raise
        except Exception as e:
            raise from_replica_error(e) from None

    def usage(self) -> dict:
        return usage(self.num_prompt_tokens, len(self.text.ids), self.stats)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


# ---- the deployment -------------------------------------------------------------------------


@serve.deployment
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, engine: DeploymentHandle, config: dict):
        from engine.loading import load_tokenizer

        self.engine = engine
        self.config = AppConfig.model_validate(config)
        api.state.api_keys = [*(k.get_secret_value() for k in self.config.api_keys), *env_api_keys()]
        api.state.max_request_bytes = self.config.max_request_bytes
        self.tokenizer = load_tokenizer(resolve_model_path(self.config.engine.target))
        self.created = int(time.time())
        self._info: ReplicaInfo | None = None
        self.metrics = RequestMetrics(self.config.model_name, self.config.topology)

    @api.get("/health", responses={503: {"model": ErrorResponse, "description": "no healthy engine replica"}})
    async def health(self):
        try:
            replica = await asyncio.wait_for(self.engine.health.remote(), 10)
        except Exception as e:
            if isinstance(getattr(e, "cause", e), BackPressureError):
                return from_replica_error(e).response()
            return APIError(503, f"no healthy engine replica: {type(e).__name__}").response()
        return {"status": "ok", "engine": replica}

    @api.get("/v1/models", responses=ERRORS)
    async def models(self):
        info = await self._replica_info()
        return {"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "dflash-serve",
            "max_model_len": info.max_len, "drafter": info.drafter, "max_block_size": info.max_block_size,
        }]}

    @api.post("/v1/chat/completions", responses=GENERATED)
    async def chat_completions(self, body: ChatCompletionRequest, raw: Request):
        self._check(body)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template that rejects these messages (e.g. role order)
            raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from None
        prompt_ids = self.tokenizer(text, add_special_tokens=False).input_ids
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self._respond(body, prompt_ids, max_tokens, "chatcmpl", chat=True, tenant=self._tenant(raw))

    @api.post("/v1/completions", responses=GENERATED)
    async def completions(self, body: CompletionRequest, raw: Request):
        self._check(body)
        prompt = body.prompt
        prompt_ids = list(prompt) if isinstance(prompt, list) else self.tokenizer(prompt).input_ids
        return await self._respond(body, prompt_ids, body.max_tokens, "cmpl", chat=False, tenant=self._tenant(raw))

    # ---- helpers ----

    def _tenant(self, raw: Request) -> str | None:
        """With API keys on, a hash of the request's key: suffix drafting proposes a key's own earlier outputs
        only (the key itself never leaves this replica). None without keys: one shared index."""
        if not api.state.api_keys:
            return None
        key = raw.headers.get("authorization", "").partition(" ")[2].strip()
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def _check(self, body: SamplingRequest):
        if body.model is not None and body.model != self.config.model_name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves "
                                f"'{self.config.model_name}'", param="model", code="model_not_found")
        body.check_supported()

    async def _replica_info(self) -> ReplicaInfo:
        if self._info is None:
            self._info = await self.engine.info.remote()
        return self._info

    async def _respond(self, body: SamplingRequest, prompt_ids: list[int], max_tokens: int | None, prefix: str,
                       chat: bool, tenant: str | None = None):
        params = replace(body.sampling_params(max_tokens), tenant=tenant)
        generation = Generation(self.engine, self.tokenizer, prompt_ids, params, body.stop,
                                self.config.request_timeout_s, self.metrics)
        deltas = generation.deltas()
        try:
            first = await anext(deltas)  # errors before the first token still get their HTTP status
        except BaseException:
            await deltas.aclose()
            raise
        request_id, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._stream(generation, first, deltas, request_id, created, chat, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text = first
        try:
            async for delta in deltas:
                text += delta
        finally:
            await deltas.aclose()
        choice = {"index": 0, "logprobs": None, "finish_reason": generation.finish_reason}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.config.model_name, "choices": [choice], "usage": generation.usage()}

    async def _stream(self, generation: Generation, first: str, deltas, request_id, created, chat, include_usage):
        """SSE in OpenAI's chunk format; the client leaving cancels this and so the replica stream."""
        head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.config.model_name}
        extra = {"usage": None} if include_usage else {}

        def chunk(text: str | None, finish_reason: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {"content": text} if text else {}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            return sse({**head, "choices": [choice], **extra})

        try:
            if chat:
                yield chunk(None, None, role=True)
            yield chunk(first, generation.finish_reason)
            async for delta in deltas:
                yield chunk(delta, generation.finish_reason)
            if include_usage:
                yield sse({**head, "choices": [], "usage": generation.usage()})
        except APIError as e:  # after the response started, an error can only be an event
            yield sse(e.body())
        finally:
            await deltas.aclose()
        yield sse("[DONE]")
