"""The OpenAI-compatible HTTP server of `launch.py serve` (FastAPI on uvicorn with uvloop), and
the serving frontend's main loop: HTTP and (with --client-address) kvflow's ZMQ clients on one
AsyncEngine, in one process, one event loop.

Errors are OpenAI's error object `{"error": {"message", "type", "param", "code"}}`: 400 for
invalid input (FastAPI's 422 never reaches a client), 401 for a missing or wrong API key on
/v1/*, 404 for an unknown model or path, 503 when the engine is dead or too many requests wait
(with Retry-After), 500 only for bugs. A client that disconnects has its requests aborted.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Iterator

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

import kvflow
from kvflow.errors import EngineDeadError
from kvflow.frontend.api.protocol import (ApiError, ChatRequest, CompletionRequest,
                                          StreamOptions, parse)
from kvflow.frontend.api.serving import Job, Serving, error_body
from kvflow.frontend.async_engine import AsyncEngine
from kvflow.frontend.engine_client import MultiprocEngine
from kvflow.frontend.metrics import Metrics
from kvflow.frontend.processor import InputProcessor, Prompt
from kvflow.frontend.server import ZmqServer
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "default"
    api_key: str | None = None
    client_address: str | None = None
    max_waiting_requests: int | None = None


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status, headers, media_type="application/json")


def _error(e: ApiError, headers: dict[str, str] | None = None) -> Response:
    return _json(error_body(e), e.status, headers)


def build_app(engine: AsyncEngine, opts: ServeOptions) -> FastAPI:
    app = FastAPI(title="kvflow", version=kvflow.__version__, openapi_url=None)
    serving = Serving(engine, opts.model_name)
    _add_error_handlers(app)
    _add_auth(app, opts.api_key)
    _add_info_routes(app, engine, opts)
    _add_token_routes(app, engine)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse(await request.body(), CompletionRequest)
        _check_model(req.model, opts)
        return await _generate(request, engine, opts, serving, Job("text_completion",
                                                                   opts.model_name),
                               serving.completion_items(req), req.stream,
                               req.stream_options, req.echo)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = parse(await request.body(), ChatRequest)
        _check_model(req.model, opts)
        job = Job("chat.completion", opts.model_name, top_logprobs=req.top_logprobs)
        return await _generate(request, engine, opts, serving, job, serving.chat_items(req),
                               req.stream, req.stream_options, False)

    return app


async def _generate(request: Request, engine: AsyncEngine, opts: ServeOptions,
                    serving: Serving, job: Job, items: list[tuple[Prompt, list[SamplingParams]]],
                    stream: bool, stream_options: StreamOptions | None, echo: bool) -> Response:
    """Submit at once (so a bad request or an overload is a status code, streaming or not),
    then answer whole or as server-sent events."""
    if stream_options is not None and not stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
    _check_capacity(engine, opts, sum(len(params) for _, params in items))
    serving.open(job, items, echo)
    if stream:
        include_usage = bool(stream_options and stream_options.include_usage)
        return StreamingResponse(_stream(serving, job, include_usage),
                                 media_type="text/event-stream")
    try:
        body = await _unless_disconnected(request, serving.respond(job))
    finally:
        serving.close(job)
    return _json(body) if body is not None else Response(status_code=499)


def _check_capacity(engine: AsyncEngine, opts: ServeOptions, num_new: int) -> None:
    limit = opts.max_waiting_requests
    if limit is None:
        return
    if num_new > limit:
        raise ApiError(400, f"the request needs {num_new} engine requests (prompts x n) but the "
                            f"server's --max-waiting-requests is {limit}", "n")
    if engine.num_waiting + num_new > limit:
        raise ApiError(503, f"{engine.num_waiting} requests are already waiting (the server's "
                            f"--max-waiting-requests is {limit}); retry later",
                       kind="service_unavailable")


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


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> Response:
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return _error(e, headers)

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, e: EngineDeadError) -> Response:
        return _error(ApiError(503, f"the engine is dead: {e}", kind="service_unavailable"))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(ApiError(e.status_code, str(e.detail), kind=kind))

    @app.exception_handler(Exception)
    async def bug(_: Request, e: Exception) -> Response:
        logger.exception("internal error")
        return _error(ApiError(500, f"internal error: {type(e).__name__}: {e}",
                               kind="server_error"))


def _add_auth(app: FastAPI, api_key: str | None) -> None:
    if api_key is not None:
        app.add_middleware(_ApiKey, expected=f"Bearer {api_key}".encode())


class _ApiKey:
    """401 on /v1/* without `Authorization: Bearer KEY` (plain ASGI: streams pass through)."""

    def __init__(self, app: Any, expected: bytes) -> None:
        self.app = app
        self.expected = expected

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
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
        if engine.dead is not None:
            return _error(ApiError(503, f"the engine is dead: {engine.dead}",
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


def _add_token_routes(app: FastAPI, engine: AsyncEngine) -> None:
    tokenizer = engine.processor.tokenizer
    config = engine.processor.config.model

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse(await request.body(), TokenizeRequest, generation=False)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", "prompt")
        try:
            text = req.prompt if req.prompt is not None else tokenizer.apply_chat_template(
                req.messages or [], req.add_generation_prompt)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        ids = tokenizer.tokenizer.encode(text, add_special_tokens=req.add_special_tokens).ids
        return _json({"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse(await request.body(), DetokenizeRequest, generation=False)
        bad = next((t for t in req.tokens if not 0 <= t < config.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary "
                                f"[0, {config.vocab_size})", "tokens")
        return _json({"prompt": tokenizer.decode(req.tokens)})


# --- the process's main loop -------------------------------------------------------------

class _Uvicorn(uvicorn.Server):
    """uvicorn that stops on SIGINT/SIGTERM without re-raising the signal afterwards (its
    default), so the frontend can fail open requests, stop the engine and exit 0; `stopping`
    is set at once, waking the loop."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.stopping = asyncio.Event()

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()

        def stop(*_: object) -> None:
            self.should_exit = True
            loop.call_soon_threadsafe(self.stopping.set)
        old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


async def serve(engine: MultiprocEngine, processor: InputProcessor, opts: ServeOptions) -> None:
    """Serve until SIGINT/SIGTERM; then fail what is open, stop the engine."""
    aengine = AsyncEngine(engine, processor, Metrics(opts.model_name))
    aengine.start()
    zmq_server = ZmqServer(aengine, opts.client_address) if opts.client_address else None
    zmq_task = (asyncio.get_running_loop().create_task(zmq_server.serve_forever())
                if zmq_server else None)
    config = uvicorn.Config(build_app(aengine, opts), host=opts.host, port=opts.port,
                            log_level="warning", timeout_graceful_shutdown=3,
                            loop="none", lifespan="off")
    server = _Uvicorn(config)
    http_task = asyncio.get_running_loop().create_task(server.serve())
    try:
        while not server.started and not http_task.done():
            await asyncio.sleep(0.05)
        if http_task.done():
            http_task.result()
            raise RuntimeError(f"the HTTP server could not start on {opts.host}:{opts.port}")
        logger.info("serving on http://%s:%d%s", opts.host, opts.port,
                    f" and kvflow clients on {opts.client_address}" if zmq_server else "")
        await _until_stopped(server, http_task, aengine)
    finally:
        await _stop(server, http_task, aengine, zmq_server, zmq_task)


async def _until_stopped(server: _Uvicorn, http_task: asyncio.Task, engine: AsyncEngine
                         ) -> None:
    """Wait for a stop signal; then fail open requests first, so their streams end and
    uvicorn's graceful shutdown does not wait on them."""
    stopped = asyncio.ensure_future(server.stopping.wait())
    await asyncio.wait({stopped, http_task}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    logger.warning("signal received; shutting down")
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
