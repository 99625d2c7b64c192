"""The OpenAI-compatible HTTP server of `launch.py serve` (FastAPI on uvicorn with uvloop), and
the serving frontend's main loop: HTTP and (with --client-address) kvflow's ZMQ clients on one
AsyncEngine, in one process, one event loop.

Errors are OpenAI's error object `{"error": {"message", "type", "param", "code"}}`: 400 for
invalid input (FastAPI's 422 never reaches a client), 401 for a missing or wrong API key on
/v1/*, /tokenize and /detokenize, 404 for an unknown model or path, 413 for a body over
--max-request-bytes, 503 when the engine is dead or too many requests wait (with Retry-After),
500 only for bugs. No response carries a traceback or an exception's text: a 500 or a dead
engine says a short message and a request id, which the server's log line carries with the
details. A client that disconnects has its requests aborted.

Limits at the door (docs/deploy.md, "Security"): the body size, a cap on open connections
(beyond it a connection is closed at once), and a deadline for a client to send a whole
request once connected (or after its previous response), so idle or half-open connections
cannot hold file descriptors.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import resource
import secrets
import signal
import socket
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Iterator

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

import kvflow
from kvflow.errors import EngineDeadError, EngineOverloadedError
from kvflow.frontend.api.protocol import (MAX_MESSAGES, ApiError, ChatRequest,
                                          CompletionRequest, parse, value_error)
from kvflow.frontend.api.serving import Job, Serving, error_body
from kvflow.frontend.async_engine import AsyncEngine
from kvflow.frontend.metrics import Metrics
from kvflow.frontend.processor import InputProcessor
from kvflow.frontend.server import ZmqServer
from kvflow.frontend.supervisor import SupervisedEngine

logger = logging.getLogger(__name__)
HTTP_BACKLOG = 2048                    # uvicorn's default


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "default"
    api_key: str | None = None
    client_address: str | None = None
    max_waiting_requests: int | None = None   # None: default_max_waiting(max_num_seqs)
    max_n: int | None = None                  # None: max_num_seqs
    max_request_bytes: int = 4 * 2**20
    max_connections: int = 1024
    http_timeout: float = 30.0
    shutdown_timeout: float = 30.0            # drain on SIGTERM for up to this (0: at once)
    auto_tool_parser: str | None = None       # --tool-call-parser with --enable-auto-tool-choice


def default_max_waiting(max_num_seqs: int) -> int:
    """Requests that may wait for the engine by default: four full batches."""
    return 4 * max_num_seqs


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status, headers, media_type="application/json")


def _error(e: ApiError, headers: dict[str, str] | None = None) -> Response:
    return _json(error_body(e), e.status, headers)


def build_app(engine: AsyncEngine, opts: ServeOptions) -> FastAPI:
    app = FastAPI(title="kvflow", version=kvflow.__version__, openapi_url=None)
    config = engine.processor.config
    serving = Serving(engine, opts.model_name, opts.max_n or config.scheduler.max_num_seqs,
                      opts.auto_tool_parser)
    _add_error_handlers(app)
    _add_auth(app, opts.api_key)
    _add_info_routes(app, engine, opts)
    _add_token_routes(app, engine, opts)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse(await read_body(request, opts.max_request_bytes), CompletionRequest)
        _check_model(req.model, opts)
        items = serving.completion_items(req)
        job = Job("text_completion", opts.model_name)
        with engine.admission(sum(len(params) for _, params in items)):   # 503 at once
            await serving.open(job, items, req.echo, req.timeout)
        return await _respond(request, serving, job, req)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = parse(await read_body(request, opts.max_request_bytes), ChatRequest)
        _check_model(req.model, opts)
        tools = serving.check_chat(req)
        job = Job("chat.completion", opts.model_name, top_logprobs=req.top_logprobs,
                  tools=tools)
        with engine.admission(req.n):                                     # 503 at once
            items = await engine.run_blocking(serving.chat_items, req, tools)   # off the loop
            await serving.open(job, items, False, req.timeout)
        return await _respond(request, serving, job, req)

    return app


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed `limit` bytes (from Content-Length,
    else while it streams in): never more than `limit` bytes are held."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes; at most {limit} are "
                            "accepted (--max-request-bytes)", kind="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body exceeds {limit} bytes "
                                    "(--max-request-bytes)", kind="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:                 # gone (or cut by --http-timeout): nobody to tell
        raise ApiError(400, "the client disconnected before sending the whole body") from None
    return b"".join(chunks)


async def _respond(request: Request, serving: Serving, job: Job,
                   req: CompletionRequest | ChatRequest) -> Response:
    """Answer a submitted job whole or as server-sent events (submitted first, so a bad
    request or an overload is a status code, streaming or not)."""
    stream, stream_options = req.stream, req.stream_options
    if stream:
        include_usage = bool(stream_options and stream_options.include_usage)
        return StreamingResponse(_stream(serving, job, include_usage),
                                 media_type="text/event-stream")
    try:
        body = await _unless_disconnected(request, serving.respond(job))
    finally:
        serving.close(job)
    return _json(body) if body is not None else Response(status_code=499)


async def _stream(serving: Serving, job: Job, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body. Starlette cancels it when the client goes away; `close` then aborts."""
    try:
        async for event in serving.events(job, include_usage):
            yield event
    finally:
        serving.close(job)


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it if the client disconnects first (None then)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


def _check_model(model: str | None, opts: ServeOptions) -> None:
    if model is not None and model != opts.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                            f"{opts.model_name!r}", "model", kind="not_found_error")


def engine_unavailable(reason: str) -> ApiError:
    """503 for a dead engine: the details (a worker's traceback) go to the log only."""
    request_id = uuid.uuid4().hex[:12]
    logger.warning("answered 503 (request id %s): the engine is not available: %s",
                   request_id, reason.strip().splitlines()[-1] if reason.strip() else reason)
    return ApiError(503, f"the engine is not available; retry later (request id {request_id})",
                    kind="service_unavailable")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> Response:
        headers = ({"Retry-After": "1"} if e.status == 503 else
                   {"Connection": "close"} if e.status == 413 else None)  # the rest unread
        return _error(e, headers)

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(_: Request, e: EngineOverloadedError) -> Response:
        return _error(ApiError(503, str(e), kind="service_unavailable"), {"Retry-After": "1"})

    @app.exception_handler(ValueError)
    async def invalid(_: Request, e: ValueError) -> Response:
        return _error(value_error(e))

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, e: EngineDeadError) -> Response:
        return _error(engine_unavailable(str(e)), {"Retry-After": "1"})

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(ApiError(e.status_code, str(e.detail), kind=kind))

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception) -> Response:
        request_id = uuid.uuid4().hex[:12]
        logger.exception("internal error (request id %s) on %s %s", request_id,
                         request.method, request.url.path)
        return _error(ApiError(500, f"internal error (request id {request_id})",
                               kind="server_error"))


def _add_auth(app: FastAPI, api_key: str | None) -> None:
    if api_key is not None:
        app.add_middleware(_ApiKey, expected=f"Bearer {api_key}".encode())


_OPEN_PATHS = ("/health", "/live", "/metrics", "/version")   # no key: probes and scrapers


class _ApiKey:
    """401 without `Authorization: Bearer KEY` on everything but the probes (/health,
    /metrics, /version): /v1/*, /tokenize, /detokenize (plain ASGI: streams pass through)."""

    def __init__(self, app: Any, expected: bytes) -> None:
        self.app = app
        self.expected = expected

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = _error(ApiError(401, "invalid or missing API key (Authorization: "
                                             "Bearer KEY)", kind="authentication_error"))
                await error(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _add_info_routes(app: FastAPI, engine: AsyncEngine, opts: ServeOptions) -> None:
    created = int(time.time())
    config = engine.processor.config

    @app.get("/health")
    async def health() -> Response:
        """Readiness: 503 while the engine restarts, the server drains, or it gave up."""
        state = ("the engine is not available" if engine.dead is not None else
                 "the engine is restarting" if engine.engine.restarting else
                 "the server is shutting down" if engine.draining is not None else None)
        if state is not None:
            return _error(ApiError(503, state, kind="service_unavailable"),
                          {"Retry-After": "1"})
        return Response(status_code=200)

    @app.get("/live")
    async def live() -> Response:
        """Liveness: 503 only once the server gave up on its engine (restarts used up), when
        only a new process can help; a restart or a drain is not a reason to kill it."""
        if engine.dead is not None and engine.draining is None:
            return _error(ApiError(503, "the engine is not available",
                                   kind="service_unavailable"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Response:
        return _json({"version": kvflow.__version__})

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [{
            "id": opts.model_name, "object": "model", "created": created, "owned_by": "kvflow",
            "root": config.model.path, "max_model_len": config.model.max_model_len}]})

    @app.get("/metrics")
    async def metrics() -> Response:
        assert engine.metrics is not None
        return Response(generate_latest(engine.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


def _add_token_routes(app: FastAPI, engine: AsyncEngine, opts: ServeOptions) -> None:
    tokenizer = engine.processor.tokenizer
    config = engine.processor.config.model

    def tokenize_text(req: TokenizeRequest) -> list[int]:      # in the pool
        try:
            text = req.prompt if req.prompt is not None else tokenizer.apply_chat_template(
                req.messages or [], req.add_generation_prompt)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        limit = config.max_model_len * tokenizer.max_token_chars
        if len(text) > limit:
            raise ApiError(400, f"the text has {len(text)} characters; at most {limit} "
                                "(max_model_len tokens of the longest token) are tokenized",
                           "prompt")
        return tokenizer.tokenizer.encode(text, add_special_tokens=req.add_special_tokens).ids

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse(await read_body(request, opts.max_request_bytes), TokenizeRequest,
                    generation=False)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", "prompt")
        if req.messages is not None and len(req.messages) > MAX_MESSAGES:
            raise ApiError(400, f"messages has {len(req.messages)} entries; at most "
                                f"{MAX_MESSAGES} are allowed", "messages")
        ids = await engine.run_blocking(tokenize_text, req)
        return _json({"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse(await read_body(request, opts.max_request_bytes), DetokenizeRequest,
                    generation=False)
        if len(req.tokens) > config.max_model_len:
            raise ApiError(400, f"tokens has {len(req.tokens)} ids; at most max_model_len="
                                f"{config.max_model_len} are decoded", "tokens")
        bad = next((t for t in req.tokens if not 0 <= t < config.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {str(bad)[:40]} is outside the vocabulary "
                                f"[0, {config.vocab_size})", "tokens")
        return _json({"prompt": await engine.run_blocking(tokenizer.decode, req.tokens)})


# --- the HTTP connections ----------------------------------------------------------------

class _GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with kvflow's two limits: a connection beyond
    `max_connections` is closed at once (uvicorn's own limit_concurrency would still hold it
    open to answer 503), and a client must send a whole request (headers and body) within
    `request_timeout` seconds of connecting or of its previous response (uvicorn arms no
    timer before the first request, nor while bytes trickle in)."""
    max_connections = 1024
    request_timeout = 30.0
    max_header_bytes = 64 * 1024         # request line and headers (httptools has no limit)
    _last_refusal_log = 0.0
    _deadline: asyncio.TimerHandle | None = None
    _header_bytes = 0
    _in_headers = True

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            now = time.monotonic()
            if now - _GuardedHttp._last_refusal_log > 10:
                _GuardedHttp._last_refusal_log = now
                logger.warning("refusing HTTP connections: %d are open (--max-connections)",
                               len(self.connections) - 1)
            transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.request_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_headers and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                self.transport.close()       # headers past the limit: not a real client

    def on_message_begin(self) -> None:
        self._in_headers, self._header_bytes = True, 0
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)      # the next request is complete already
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def _http_protocol(opts: ServeOptions) -> type[_GuardedHttp]:
    return type("KvflowHttp", (_GuardedHttp,), {"max_connections": opts.max_connections,
                                                "request_timeout": opts.http_timeout})


def _raise_fd_limit(wanted: int) -> None:
    """Room for `wanted` descriptors (connections plus the process's own), as far as the hard
    limit allows; warn otherwise."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < wanted:
            logger.warning("open-file limit %d is below --max-connections + 256 = %d: raise "
                           "it (ulimit -n) or lower --max-connections", new, wanted)


# --- the process's main loop -------------------------------------------------------------

class _Uvicorn(uvicorn.Server):
    """uvicorn that does not stop by itself on SIGINT/SIGTERM (nor re-raise the signal
    afterwards, its default): the first signal sets `stopping` (the frontend drains, then sets
    should_exit), a second sets `forced` too."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.stopping = asyncio.Event()
        self.forced = asyncio.Event()

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()

        def stop(*_: object) -> None:
            event = self.forced if self.stopping.is_set() else self.stopping
            loop.call_soon_threadsafe(event.set)
        old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


def bind_http(host: str, port: int) -> list[socket.socket]:
    """The HTTP sockets, bound (not yet listening) before the cluster starts, as vLLM does: a
    port another server listens on fails at once, not after the model loaded, and no socket
    the cluster binds to "any free port" can take the port first; until `serve` listens,
    connections are refused. One socket per address the host resolves to (as uvicorn's own
    bind, asyncio's create_server: "localhost" may be 127.0.0.1 and ::1, "" every
    interface). OSError names the address."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM,
                                   0, socket.AI_PASSIVE)
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:        # each family its own socket
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:
                    raise
                sockets.pop().close()            # a family this host has not enabled
        if not sockets:
            raise OSError(errno.EADDRNOTAVAIL, "no address of it can be bound")
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sockets


def _listen(sockets: list[socket.socket], host: str, port: int) -> None:
    """Listen on the sockets `bind_http` bound. Two servers may both bind a port (neither
    listening yet); the second to listen fails here, by name, rather than in uvloop, which
    would ignore it."""
    try:
        for sock in sockets:
            sock.listen(HTTP_BACKLOG)
    except OSError as e:
        raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


async def serve(engine: SupervisedEngine, processor: InputProcessor, opts: ServeOptions,
                sockets: list[socket.socket] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; then drain (up to --shutdown-timeout), stop the engine.
    `sockets`: what `bind_http` bound (None: bind opts.host:opts.port now)."""
    if sockets is not None:
        _listen(sockets, opts.host, opts.port)
    max_waiting = opts.max_waiting_requests
    if max_waiting is None:
        max_waiting = default_max_waiting(processor.config.scheduler.max_num_seqs)
    aengine = AsyncEngine(engine, processor, Metrics(opts.model_name), max_waiting)
    aengine.start()
    zmq_server = (ZmqServer(aengine, opts.client_address, opts.api_key, opts.max_request_bytes)
                  if opts.client_address else None)
    zmq_task = (asyncio.get_running_loop().create_task(zmq_server.serve_forever())
                if zmq_server else None)
    _raise_fd_limit(opts.max_connections + 256)
    config = uvicorn.Config(build_app(aengine, opts), host=opts.host, port=opts.port,
                            backlog=HTTP_BACKLOG,
                            log_level="warning", timeout_graceful_shutdown=3,
                            loop="none", lifespan="off", http=_http_protocol(opts),
                            timeout_keep_alive=5,
                            h11_max_incomplete_event_size=64 * 1024)
    server = _Uvicorn(config)
    http_task = asyncio.get_running_loop().create_task(
        server.serve(sockets=sockets))
    try:
        while not server.started and not http_task.done():
            await asyncio.sleep(0.05)
        if http_task.done():
            http_task.result()
            raise RuntimeError(f"the HTTP server could not start on {opts.host}:{opts.port}")
        logger.info("serving on http://%s:%d%s", opts.host, opts.port,
                    f" and kvflow clients on {opts.client_address}" if zmq_server else "")
        await _until_stopped(server, http_task, aengine, opts.shutdown_timeout)
    finally:
        await _stop(server, http_task, aengine, zmq_server, zmq_task)


async def _until_stopped(server: _Uvicorn, http_task: asyncio.Task, engine: AsyncEngine,
                         shutdown_timeout: float) -> None:
    """Wait for a stop signal, then drain: new requests get 503 and /health 503 (load
    balancers take this replica out) while requests in flight finish, for up to
    `shutdown_timeout` seconds or until a second signal; what is left is aborted (each answer
    ends with finish_reason "abort"), then the engine stops."""
    stopped = asyncio.ensure_future(server.stopping.wait())
    await asyncio.wait({stopped, http_task}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if http_task.done() or shutdown_timeout <= 0:
        return                               # no drain: _stop fails what is open at once
    engine.draining = "the server is shutting down; retry on another replica"
    logger.warning("signal received; draining %d request(s) for up to %g s (a second signal "
                   "stops at once)", len(engine.streams), shutdown_timeout)
    deadline = time.monotonic() + shutdown_timeout
    while ((engine.streams or engine.num_admitting) and not server.forced.is_set()
           and time.monotonic() < deadline):
        await asyncio.sleep(0.05)
    if engine.streams:
        logger.warning("aborting %d request(s) still in flight", len(engine.streams))
        engine.abort_all()
        for _ in range(40):                  # let their last chunks leave
            if not engine.streams or engine.dead is not None:
                break
            await asyncio.sleep(0.05)
    server.should_exit = True
    engine.fail_all("the server is shutting down")


async def _stop(server: _Uvicorn, http_task: asyncio.Task, engine: AsyncEngine,
                zmq_server: ZmqServer | None, zmq_task: asyncio.Task | None) -> None:
    server.should_exit = True
    engine.fail_all("the server is shutting down")     # ZMQ clients are told before closing
    if zmq_server is not None and zmq_task is not None:
        zmq_task.cancel()
        await zmq_server.close()
    await asyncio.gather(http_task, return_exceptions=True)
    await engine.shutdown()
