"""``adaflash serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one ``AdaFlashEngine``.

    adaflash serve                                   # the offline SmolLM2 target with the shipped drafter
    adaflash serve --drafter none --port 8001        # plain decoding (no drafter)
    adaflash serve --draft-source hybrid --learn     # lookup + drafter; the drafter keeps learning from the traffic

Endpoints: ``POST /v1/chat/completions`` (the tokenizer's chat template), ``POST /v1/completions`` (both streamed as
server-sent events in OpenAI's chunk format, or whole), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus text: requests running and waiting, tokens/s, τ, mean verify length, admission, the drafter weights
version, step-time percentiles, and with ``--learn`` the trainer's rounds and last loss). Request bodies and their
errors: ``openai_api``. The engine runs on its own thread (``worker.EngineWorker``); the asyncio side only queues
and streams. A client that disconnects has its request aborted; a full queue answers 429 with ``Retry-After``.

SIGTERM (or Ctrl-C): the server stops accepting connections, lets running requests finish for ``--grace-period``
seconds, stops the rest with an error their clients read (a stream's last event is an OpenAI error, then
``[DONE]``; a whole response is a 503), logs one line for them, closes the learner (its last checkpoint) and exits 0.

``build_engine`` is the one place the engine is built from the command's options.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import threading
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from transformers.utils import logging

from adaflash_hf.serving import openai_api as api
from adaflash_hf.serving.admission import AdmissionConfig
from adaflash_hf.serving.cache import packed_forward_timer
from adaflash_hf.serving.engine import AdaFlashEngine
from adaflash_hf.serving.memory import limit_malloc_arenas
from adaflash_hf.serving.worker import EngineWorker, QueueFull, ShuttingDown, in_own_thread

logger = logging.get_logger(__name__)

DEFAULT_DRAFTER = Path(__file__).resolve().parents[2] / "examples" / "drafters" / "smollm2-135m-adaflash"
DISCONNECT_POLL_S = 0.25
SHUTDOWN_MARGIN_S = 5.0
FALLBACK_TOKEN_BUDGET = 2048  # a target whose config states no context


def build_engine(
    target,
    drafter=None,
    *,
    draft_source: str = "auto",
    length_mode: str = "auto",
    max_running: int = 16,
    seed: int = 0,
    token_budget: int | None = None,
) -> AdaFlashEngine:
    """The server's engine: plain decoding without a drafter, else AdaFlash with the given drafting settings.

    ``token_budget`` (``--token-budget``): the most tokens one target forward takes, prompts being prefilled and
    drafts being verified together; a prompt longer than it is refused. None: the model's context, so any prompt
    the context holds is served (a long prompt's prefill then makes one long step for every running request)."""
    block = drafter.config.block_size if drafter is not None else 16
    if token_budget is None:
        token_budget = max(context_tokens(target) or FALLBACK_TOKEN_BUDGET, max_running * block)
    admission = AdmissionConfig(max_running=max_running, token_budget=token_budget)
    if drafter is None:
        return AdaFlashEngine(target, admission=admission, seed=seed)
    return AdaFlashEngine(
        target, drafter, admission=admission, draft_source=draft_source, length_mode=length_mode, seed=seed
    )


def context_tokens(target) -> int | None:
    """The target's context in tokens (its ``max_position_embeddings``), or None where its config has none."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return getattr(config, "max_position_embeddings", None)


def _error(error: api.OpenAIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _failure(error: BaseException) -> api.OpenAIError:
    """A running request the worker ended with an error: cut by the shutdown (503), or the engine thread failed."""
    if isinstance(error, ShuttingDown):
        return api.OpenAIError(str(error), status=503, code="shutting_down")
    return api.OpenAIError(f"engine: {error!r}", status=500)


def create_app(
    worker: EngineWorker,
    tokenizer,
    model_name: str,
    default_max_tokens: int = 256,
    grace_s: float = 30.0,
    learner=None,
) -> FastAPI:
    """The ASGI app over a worker (started and stopped by the app's lifespan) and an optional learner."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if learner is not None:
            learner.start()
        worker.start()
        yield
        # uvicorn has already waited up to its graceful timeout for the responses in flight.
        await asyncio.to_thread(worker.shutdown, 0.0)
        if learner is not None:
            await asyncio.to_thread(learner.close, grace_s)

    app = FastAPI(title="adaflash serve", lifespan=lifespan)
    app.state.worker = worker  # closed first when the server stops (``uvicorn_server``)

    @app.exception_handler(api.OpenAIError)
    async def openai_error(request, error: api.OpenAIError):
        return _error(error)

    @app.exception_handler(Exception)
    async def unexpected_error(request, error: Exception):
        # A bug, not the client's input: the client still gets OpenAI's error body (not plain text it cannot
        # parse), and the log keeps the traceback.
        return _error(api.OpenAIError(f"server: unexpected {type(error).__name__}: {error}", status=500))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(request, True, worker, tokenizer, model_name, default_max_tokens)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, False, worker, tokenizer, model_name, default_max_tokens)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "adaflash"}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if worker.is_alive() and worker.error is None:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(worker, learner), media_type="text/plain; version=0.0.4")

    return app


async def _complete(
    request: Request, chat: bool, worker, tokenizer, model_name: str, default_max_tokens: int
):
    """One chat or completion request: parse and check it, submit it, then stream it or answer it whole."""
    engine = worker.engine
    body = api.parse_body(await request.body(), api.ChatCompletionRequest if chat else api.CompletionRequest)
    api.check_model(body, model_name)
    stop = api.stop_strings(body)
    if chat:
        prompt_field, prompt = "messages", api.chat_prompt_ids(tokenizer, body)
    else:
        prompt_field, prompt = "prompt", api.completion_prompt_ids(tokenizer, body, engine.vocab_size)
    params = api.sampling_params(body, len(prompt), engine.max_positions, default_max_tokens, prompt_field)
    budget = engine.admission.config.token_budget
    # The context may hold a prompt that one step's forward cannot take (adaflash serve --token-budget).
    if len(prompt) > budget:
        raise api.OpenAIError(
            f"{prompt_field}: expected a prompt of at most {budget} tokens (the server's --token-budget: the tokens "
            f"one step's forward takes), got {len(prompt)}",
            param=prompt_field,
        )
    try:
        handle = worker.submit(prompt, params, stop, prefix="chatcmpl" if chat else "cmpl")
    except QueueFull as error:
        busy = api.OpenAIError(str(error), status=429, code="server_busy")
        return _error(busy, headers={"Retry-After": str(error.retry_after)})
    except ShuttingDown as error:
        return _error(api.OpenAIError(str(error), status=503, code="shutting_down"))
    try:
        first = await handle.queue.get()
    except asyncio.CancelledError:
        worker.abort(handle.request_id)
        raise
    if (
        first.kind == "failed"
    ):  # refused by the engine (its budgets), cut by the shutdown, or the engine failed
        if isinstance(first.error, (ValueError, TypeError)):
            return _error(api.OpenAIError(str(first.error), param=prompt_field))
        return _error(_failure(first.error))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        writer = api.ChunkWriter(chat, handle.request_id, model_name, include_usage)
        return StreamingResponse(_stream(worker, handle, writer), media_type="text/event-stream")
    return await _whole(worker, handle, request, chat, model_name)


async def _whole(worker, handle, request: Request, chat: bool, model_name: str):
    """Collect a request's text; a client that went away meanwhile has its request aborted."""
    pieces, done = [], False
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            # Checked on a clock, not only when no text arrives: a busy request sends text at every step.
            try:
                event = await asyncio.wait_for(handle.queue.get(), max(0.0, check_at - loop.time()))
            except TimeoutError:
                event = None
            if loop.time() >= check_at:
                if await request.is_disconnected():
                    return JSONResponse({}, status_code=499)
                check_at = loop.time() + DISCONNECT_POLL_S
            if event is None:
                continue
            if event.kind == "text":
                pieces.append(event.text)
            elif event.kind == "failed":
                done = True
                return _error(_failure(event.error))
            else:
                done = True
                return api.response_body(
                    chat, handle.request_id, model_name, "".join(pieces), event, int(time.time())
                )
    finally:
        if not done:
            worker.abort(handle.request_id)


async def _stream(worker, handle, writer: api.ChunkWriter):
    """Server-sent events until the request finishes; a disconnect cancels this generator, which aborts it."""
    done = False
    try:
        if start := writer.start():
            yield start
        while True:
            event = await handle.queue.get()
            if event.kind == "text":
                yield writer.text(event.text)
                continue
            done = True
            if event.kind == "failed":
                yield writer.error(_failure(event.error))
            else:
                yield writer.finish(event)
            return
    finally:
        if not done:
            worker.abort(handle.request_id)


# ------------------------------------------------------------------------------------------------------- metrics
METRICS = {  # name -> (type, help, snapshot key)
    "adaflash_requests_running": ("gauge", "Requests in the engine's batch", None),
    "adaflash_requests_waiting": ("gauge", "Accepted requests not yet in the batch", None),
    "adaflash_tokens_per_second": (
        "gauge",
        "Generated tokens per second over the last steps",
        "tokens_per_second",
    ),
    "adaflash_tau": ("gauge", "Committed tokens per verify round over the last finished requests", "tau"),
    "adaflash_step_tau": ("gauge", "Committed tokens per verifying request over the last steps", "step_tau"),
    "adaflash_mean_verify_length": (
        "gauge",
        "Drafts verified per verify over the last steps",
        "mean_verify_length",
    ),
    "adaflash_admission_ema_running": ("gauge", "Admission's EMA of running requests", "ema_running"),
    "adaflash_admission_gamma": ("gauge", "Length-head gamma used by the last step", "gamma"),
    "adaflash_drafter_weights_version": ("gauge", "Version of the drafter weights being served", None),
    "adaflash_step_seconds_p50": ("gauge", "Median engine step time over the last steps", "step_seconds_p50"),
    "adaflash_step_seconds_p99": (
        "gauge",
        "99th percentile engine step time over the last steps",
        "step_seconds_p99",
    ),
    "adaflash_steps_total": ("counter", "Engine steps", "steps"),
    "adaflash_generated_tokens_total": ("counter", "Tokens generated", "tokens"),
    "adaflash_verify_rounds_total": ("counter", "Verify rounds of finished requests", "verify_rounds"),
    "adaflash_accepted_drafts_total": ("counter", "Accepted drafts of finished requests", "accepted_drafts"),
    "adaflash_requests_rejected_total": ("counter", "Requests answered 429 (queue full)", "rejected_busy"),
    "process_resident_memory_bytes": ("gauge", "Resident memory of the server process", None),
}


def resident_memory_bytes() -> int:
    """The process's resident set (Linux /proc; 0 where it is not available)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def metrics_text(worker: EngineWorker, learner=None) -> str:
    """Prometheus text exposition of the worker's (and the learner's) live statistics."""
    snapshot = worker.stats.snapshot()
    running = len(worker.engine.running)
    snapshot |= {
        "adaflash_requests_running": running,
        "adaflash_requests_waiting": max(0, worker.accepted - running),
        "adaflash_drafter_weights_version": int(getattr(worker.engine.drafter, "weights_version", 0) or 0),
        "process_resident_memory_bytes": resident_memory_bytes(),
    }
    lines = []
    for name, (kind, help_text, key) in METRICS.items():
        lines += [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} {kind}",
            f"{name} {_number(snapshot.get(key or name, 0))}",
        ]
    lines += ["# HELP adaflash_requests_finished_total Finished requests by finish reason"]
    lines += ["# TYPE adaflash_requests_finished_total counter"]
    for reason in ("stop", "length", "abort"):
        lines.append(
            f'adaflash_requests_finished_total{{reason="{reason}"}} {snapshot.get(f"finished_{reason}", 0)}'
        )
    for name, value in (learner.metrics() if learner is not None else {}).items():
        lines += [f"# TYPE adaflash_{name} gauge", f"adaflash_{name} {_number(value)}"]
    return "\n".join(lines) + "\n"


def _number(value) -> str:
    return "NaN" if value != value else str(value)  # Prometheus spells not-a-number NaN


# ------------------------------------------------------------------------------------------------------- running
def bind(host: str, port: int, names: tuple[str, str] = ("host", "port")) -> socket.socket:
    """A listening socket (port 0: a free one), bound before the model loads are announced. An address or port it
    cannot listen on is one ``OSError`` naming ``names`` (the options they came from) and the value."""
    host_name, port_name = names
    if not (isinstance(port, int) and 0 <= port <= 65535):
        raise ValueError(f"{port_name}: expected an int in 0..65535 (0: a free one), got {port!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except (OSError, ValueError, TypeError) as error:  # a name IDNA cannot encode, a NUL in the name
        sock.close()
        reason = getattr(error, "strerror", None) or str(error)
        if isinstance(error, OSError) and error.errno in (errno.EADDRINUSE, errno.EACCES):
            raise OSError(
                f"{port_name}: expected a port free for this process to listen on, got {port} ({reason})"
            ) from None
        raise OSError(
            f"{host_name}: expected an address of this machine to listen on, got {host!r} ({reason})"
        ) from None
    return sock


def uvicorn_server(app: FastAPI, grace_s: float, log_level: str):
    """uvicorn's server for ``app`` that, once it stops taking connections, hands the grace period to the app's
    worker: a request still running at its end is stopped with an error its client reads (a stream's last event).
    uvicorn's own graceful timeout comes ``SHUTDOWN_MARGIN_S`` later, for the last events to go out: at its end it
    cancels the responses still open, which would cut a stream without a word."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            worker = getattr(app.state, "worker", None)
            if worker is not None:
                worker.close(grace_s)
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app, timeout_graceful_shutdown=grace_s + SHUTDOWN_MARGIN_S, log_level=log_level, lifespan="on"
    )
    return Server(config)


def run(app: FastAPI, sock: socket.socket, grace_s: float = 30.0, log_level: str = "info") -> int:
    """Serve ``app`` on ``sock`` until SIGTERM or SIGINT, then stop gracefully; returns 0."""
    server = uvicorn_server(app, grace_s, log_level)
    # uvicorn re-raises the signal it stopped on once it has restored the previous handlers: with these no-op
    # handlers in place the process then exits with status 0 instead of dying of SIGTERM.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1


class BackgroundServer:
    """``app`` served by uvicorn in a daemon thread (a notebook, a test): ``with BackgroundServer(app) as server:``
    then ``server.base_url`` (``http://127.0.0.1:<free port>/v1``); leaving the block stops it gracefully."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, grace_s: float = 5.0):
        self.sock = bind(host, port)
        self.base_url = f"http://{host}:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn_server(app, grace_s, "warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server: expected it to start within 60 s, got no start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()


def load_drafter_for(target, drafter: str | None):
    """``--drafter``: None (the shipped SmolLM2 drafter), "none" (plain decoding) or a checkpoint folder / repo id."""
    from adaflash_hf.interop import load_drafter

    if drafter == "none":
        return None
    if drafter is None:
        if not DEFAULT_DRAFTER.is_dir():
            raise FileNotFoundError(
                f"--drafter: expected a drafter folder (the default {DEFAULT_DRAFTER} is missing)"
            )
        drafter = str(DEFAULT_DRAFTER)
    return load_drafter(drafter).to(next(target.parameters()).dtype).eval()  # the engine checks it fits


def prepare_served_target(target, dtype: str, learn: bool) -> None:
    """``--dtype``: "auto" runs ``prepare_target``'s choice, timed on the engine's packed forward of sixteen requests
    (bf16 with the batch-invariant forward where that serves more tokens per second than eager fp32 and decodes no
    slower, and the same on the target's 4-bit codes where its linears are 4-bit and that serves more; fp32
    elsewhere, and on a CPU without bf16 units), except with ``--learn``, whose trainer needs fp32 weights; "bf16"
    prepares a bf16 target whatever the CPU, "int4" one on its 4-bit codes; "fp32" leaves the target as loaded."""
    from adaflash_hf.prepared.prepare import prepare_target

    if dtype in ("bf16", "int4") or (dtype == "auto" and not learn):
        prepare_target(target, dtype=dtype, timer=packed_forward_timer)
    elif dtype == "auto":
        logger.info("--dtype auto: fp32 with --learn (the trainer's drafter trains and publishes in fp32)")


def served_engine(
    target_name: str,
    drafter: str | None = None,
    *,
    dtype: str = "auto",
    learn: bool = False,
    draft_source: str = "auto",
    length_mode: str | None = None,
    max_running: int = 16,
    token_budget: int | None = None,
):
    """``(engine, target, tokenizer)`` as ``adaflash serve`` builds them from its options: a private copy of the
    target prepared per ``--dtype``, the ``--drafter`` (None: the shipped one; "none": plain decoding), and
    ``--length-mode`` (None: adaptive with ``--learn``, the feedback OPD learns from, else auto)."""
    from adaflash_hf.assets import load_target

    target, tokenizer = load_target(target_name, fresh=True)  # the server's own: prepared in place
    prepare_served_target(target, dtype, learn)
    engine = build_engine(
        target,
        load_drafter_for(target, drafter),
        draft_source=draft_source,
        length_mode=length_mode or ("adaptive" if learn else "auto"),
        max_running=max_running,
        token_budget=token_budget,
    )
    return engine, target, tokenizer


def serve(options, learner_factory=None) -> int:
    """Load the target and drafter of ``options`` (``adaflash serve``'s arguments), build the engine, worker and
    app, and serve. ``learner_factory(engine, target, tokenizer)`` gives the learner of ``--learn``."""
    limit_malloc_arenas()  # before any of the server's threads start (adaflash_hf.serving.memory)
    if options.learn and options.drafter == "none":
        raise ValueError("--learn: expected a drafter to train, got --drafter none (plain decoding)")
    if options.learn and options.dtype in ("bf16", "int4"):
        raise ValueError(
            "--dtype: expected auto or fp32 with --learn (the trainer's drafter publishes weights in the serving "
            f"dtype, and AdamW on bf16 weights loses its small updates), got {options.dtype}"
        )
    sock = bind(options.host, options.port, names=("--host", "--port"))
    # built on a thread that ends before the engine's starts: the engine's thread is then the only one with an
    # OpenMP team (worker.in_own_thread)
    engine, target, tokenizer = in_own_thread(
        served_engine,
        options.target,
        options.drafter,
        dtype=options.dtype,
        learn=options.learn,
        draft_source=options.draft_source,
        length_mode=options.length_mode,
        max_running=options.max_running,
        token_budget=options.token_budget,
    )
    learner = (
        in_own_thread(learner_factory, engine, target, tokenizer) if learner_factory is not None else None
    )
    worker = EngineWorker(engine, tokenizer, max_waiting=options.max_waiting, learner=learner)
    model_name = options.served_model_name or Path(options.target).name
    app = create_app(worker, tokenizer, model_name, options.default_max_tokens, options.grace_period, learner)
    host, port = sock.getsockname()[:2]
    dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
    print(f"adaflash serve: {model_name} ({dtype}) on http://{host}:{port}/v1", flush=True)
    return run(app, sock, options.grace_period)
