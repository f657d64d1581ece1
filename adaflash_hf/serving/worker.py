"""The engine thread of ``adaflash serve`` and of the online loop (``online.loop.run_online``): one thread owns the
``AdaFlashEngine`` and steps it; the HTTP side (or the loop's traffic source) only submits requests and reads their
events.

    worker = EngineWorker(engine, tokenizer, max_waiting=64)
    worker.start()
    handle = worker.submit(prompt_ids, SamplingParams(max_new_tokens=64), stop=["\\n"], loop=asyncio loop)
    event = await handle.queue.get()    # Event("accepted"), then "text" pieces, then "finished" (or "failed")
    worker.abort(handle.request_id)     # the client went away: its slot and cache are freed at the next step
    worker.shutdown(grace_s=30)         # take nothing new, let the running requests finish, stop the rest

Everything the engine sees happens on this thread between two steps: new requests (``add_request``; a request the
engine refuses gets a "failed" event with its error), aborts, and the learner's ``between_steps`` (the hot reloader),
so no request ever sees the drafter's weights change inside a step. Events reach the asyncio side through
``loop.call_soon_threadsafe``. Text is detokenized here, per request (``detokenize.IncrementalText``): a stop string
ends the request at once (aborted in the engine, ``finish_reason="stop"``), and tokens a step committed past it are
dropped.

Bounded: at most ``max_running`` (the engine's admission) + ``max_waiting`` requests (or ``capacity``) are accepted
at once; past that ``submit`` raises ``QueueFull`` without queueing anything. The engine forgets a request once it
yields its final output and keeps a bounded window of step stats, and ``ServingStats`` keeps windows and counters,
so memory stays flat however long it serves.

Without a tokenizer (the online loop) nothing is detokenized: no "text" events, and stop strings are not supported.
A caller without an asyncio loop hands ``submit`` an ``on_event`` callable, called on the engine thread.

Build the engine with ``in_own_thread`` where the thread that builds it goes on running (a server's event loop, a
notebook): a thread that ran torch's parallel ops keeps an OpenMP team, and with two teams in the process libgomp
slows the engine thread's ops to about half their speed.

A learner (``--learn``) is any object with ``between_steps()`` and ``request_ended(request)``; the second is called for
every request that ends, aborted ones included (their rounds were never pushed by the engine's round recorder).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.utils import logging

from adaflash_hf.serving.detokenize import IncrementalText
from adaflash_hf.serving.memory import trim_heap
from adaflash_hf.serving.requests import SamplingParams
from adaflash_hf.stats import tau_of

logger = logging.get_logger(__name__)

WINDOW = 256  # steps and finished requests the live statistics are taken over


class QueueFull(Exception):
    """``max_running + max_waiting`` requests are already accepted; try again after ``retry_after`` seconds."""

    def __init__(self, accepted: int, retry_after: int):
        super().__init__(
            f"server busy: {accepted} requests accepted (the limit), retry after {retry_after} s"
        )
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """The server stopped taking requests."""


@dataclass
class Event:
    kind: str  # "accepted" | "text" | "finished" | "failed"
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: Exception | None = None
    extra: dict | None = None  # "finished": the request's drafting statistics


@dataclass
class Handle:
    request_id: str
    loop: asyncio.AbstractEventLoop | None
    queue: asyncio.Queue | None
    on_event: Callable[[Event], None] | None = None  # instead of the queue, on the engine thread

    def emit(self, event: Event) -> None:
        if self.on_event is not None:
            self.on_event(event)
        else:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


@dataclass
class _Live:
    handle: Handle
    text: IncrementalText | None  # None: no tokenizer, tokens are only counted
    prompt_tokens: int
    tokens: int = 0  # without ``text``

    @property
    def tokens_used(self) -> int:
        return self.tokens if self.text is None else self.text.tokens_used


class ServingStats:
    """Live statistics for ``/metrics``: windows over the last steps and finished requests, and counters."""

    def __init__(self):
        self.lock = threading.Lock()
        self.steps: deque = deque(maxlen=WINDOW)  # (finished at, seconds, committed + prefills, StepStats)
        self.requests: deque = deque(maxlen=WINDOW)  # (verify rounds, accepted drafts) of finished requests
        self.counters: Counter[str] = Counter()

    def add_step(self, stats, seconds: float) -> None:
        with self.lock:
            self.steps.append((time.monotonic(), seconds, stats.committed + stats.admitted, stats))
            self.counters["steps"] += 1
            self.counters["tokens"] += stats.committed + stats.admitted

    def add_request(self, finish_reason: str, rounds: int, accepted: int) -> None:
        with self.lock:
            self.counters[f"finished_{finish_reason}"] += 1
            self.counters["verify_rounds"] += rounds
            self.counters["accepted_drafts"] += accepted
            if rounds:
                self.requests.append((rounds, accepted))

    def add_trajectory(self, trajectory) -> None:
        """Count a recorded trajectory's drafting rounds under its domain (a ``ReplayBuffer`` listener)."""
        with self.lock:
            domain = trajectory.domain
            self.counters[f"trajectories/{domain}"] += 1
            self.counters[f"rounds/{domain}"] += len(trajectory.accepted)
            self.counters[f"accepted/{domain}"] += sum(trajectory.accepted)
            self.counters[f"drafted/{domain}"] += sum(trajectory.draft_lengths)

    def count(self, name: str) -> None:
        with self.lock:
            self.counters[name] += 1

    def totals(self) -> Counter[str]:
        """A copy of the counters (totals since the start)."""
        with self.lock:
            return Counter(self.counters)

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            steps, requests, counters = list(self.steps), list(self.requests), dict(self.counters)
        seconds = sorted(s for _, s, _, _ in steps)
        span = steps[-1][0] - steps[0][0] + steps[0][1] if steps else 0.0
        last = steps[-1][3] if steps else None
        verifies = sum(s.verifies for *_, s in steps)
        rounds = sum(r for r, _ in requests)
        return {
            "tokens_per_second": sum(t for _, _, t, _ in steps) / span if span > 0 else 0.0,
            "step_seconds_p50": _percentile(seconds, 0.5),
            "step_seconds_p99": _percentile(seconds, 0.99),
            "tau": tau_of(sum(a for _, a in requests) + rounds, rounds),
            "step_tau": tau_of(sum(s.committed for *_, s in steps), verifies),
            "mean_verify_length": sum(s.draft_tokens for *_, s in steps) / verifies if verifies else 0.0,
            "gamma": last.gamma if last else 0.0,
            "ema_running": last.ema_running if last else 0.0,
            **counters,
        }


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def in_own_thread(function: Callable, *args, **kwargs):
    """``function(*args, **kwargs)`` run on a thread of its own that ends when it returns; its result is returned and
    its exception raised here. Build what the engine thread serves this way (load, prepare, calibrate), not on the
    thread that then waits on the server: torch's CPU ops run on OpenMP (libgomp), which gives every thread that
    ever ran a parallel op a team of worker threads for that thread's life, and while more such threads exist than
    cores it stops their workers from spin-waiting, so every parallel op waits for sleeping workers to wake. A target
    loaded on the main thread and served from the engine's ran its ops at 0.4-0.7x and the engine at half its speed
    (a 2-core Intel Xeon); built on a thread that has ended, the engine's is the only team."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = function(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - raised again on the caller's thread
            result["error"] = error

    thread = threading.Thread(target=run, name=f"adaflash-build-{getattr(function, '__name__', 'call')}")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def pin_torch_threads(threads: int) -> None:
    """Give the calling thread ``threads`` torch threads for the rest of its life. torch sets a thread's count from
    its last ``set_num_threads`` anywhere at that thread's first op: initialised first, the thread keeps its own.
    The count also becomes torch's for threads that have not run an op yet."""
    torch.get_num_threads()  # the thread's first-use initialisation, from torch's last set count
    torch.set_num_threads(threads)


class EngineWorker(threading.Thread):
    """See the module docstring."""

    def __init__(
        self,
        engine,
        tokenizer,
        max_waiting: int = 64,
        learner=None,
        retry_after: int = 1,
        capacity: int | None = None,
    ):
        super().__init__(name="adaflash-engine", daemon=True)
        if not (isinstance(max_waiting, int) and max_waiting >= 0):
            raise ValueError(f"max_waiting: expected an int >= 0, got {max_waiting!r}")
        if capacity is not None and not (isinstance(capacity, int) and capacity >= 1):
            raise ValueError(f"capacity: expected an int >= 1, got {capacity!r}")
        self.engine, self.tokenizer, self.learner = engine, tokenizer, learner
        self.capacity = capacity or engine.admission.config.max_running + max_waiting
        self.retry_after = retry_after
        self.stats = ServingStats()
        self.error: BaseException | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._accepted = 0  # submitted and not yet ended, inbox included
        self._closing = False
        self._deadline: float | None = None
        self._grace_s = 0.0
        self._busy = False
        # the engine thread's torch threads: its creator's (a thread takes torch's last set count at its first op,
        # and a learner beside it trains on one)
        self.threads = torch.get_num_threads()

    # ------------------------------------------------------------------------------------ HTTP side (any thread)
    @property
    def accepted(self) -> int:
        with self._lock:
            return self._accepted

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stop=(),
        loop=None,
        prefix: str = "cmpl",
        request_id: str | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> Handle:
        """Queue a request for the engine thread; raises ``QueueFull`` or ``ShuttingDown`` instead of queueing.
        Its events go to ``on_event`` if given, else to ``handle.queue`` on ``loop`` (default: the running asyncio
        loop); its id is ``request_id`` or a new ``{prefix}-...``."""
        if stop and self.tokenizer is None:
            raise ValueError(
                f"stop: expected none without a tokenizer to find it in the text, got {list(stop)}"
            )
        with self._lock:
            if self._closing or not self.is_alive():
                raise ShuttingDown("server: expected to be running, got shutting down")
            if self._accepted >= self.capacity:
                self.stats.count("rejected_busy")
                raise QueueFull(self._accepted, self.retry_after)
            self._accepted += 1
        request_id = request_id or f"{prefix}-{uuid.uuid4().hex[:24]}"
        if on_event is not None:
            handle = Handle(request_id, None, None, on_event)
        else:
            handle = Handle(request_id, loop or asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(("add", handle, list(prompt_ids), params, tuple(stop)))
        return handle

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def close(self, grace_s: float = 30.0) -> None:
        """Stop taking requests; running ones get ``grace_s`` seconds to finish, then each is stopped with a
        "failed" event (``ShuttingDown``) its client is told; returns at once. A second call can only bring the
        deadline closer."""
        with self._lock:
            self._closing = True
        self._inbox.put(("close", time.monotonic() + grace_s, grace_s))

    def shutdown(self, grace_s: float = 30.0) -> None:
        """``close(grace_s)``, then wait for the thread to end."""
        self.close(grace_s)
        self.join()

    # -------------------------------------------------------------------------------------------- engine thread
    def run(self) -> None:
        pin_torch_threads(self.threads)
        engine = self.engine
        try:
            while True:
                self._drain(block=not engine.has_unfinished())
                if self._deadline is not None and time.monotonic() >= self._deadline and self._live:
                    self._cut_at_deadline()
                if not engine.has_unfinished():
                    if self._deadline is not None and self._inbox.empty():
                        return
                    if self._busy:  # just went idle: give the freed pages of the last requests back
                        self._busy = False
                        trim_heap()
                    continue
                self._busy = True
                if self.learner is not None:
                    self.learner.between_steps()
                steps, started = engine.step_count, time.perf_counter()
                outputs = engine.step()
                if engine.step_count > steps:  # a step that only ended aborted requests records none
                    self.stats.add_step(engine.stats[-1], time.perf_counter() - started)
                for output in outputs:
                    self._deliver(output)
        except BaseException as error:  # every waiting client gets it as a failure
            logger.error(f"engine thread failed: {error!r}")
            self.error = error
            with self._lock:
                self._closing = True
            for live in self._live.values():
                live.handle.emit(Event("failed", error=error))
            self._live.clear()

    def _drain(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
            while True:
                self._command(*command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _cut_at_deadline(self) -> None:
        """The grace period is over: every request still live ends with an error its client reads (a stream's last
        event, a whole response's 503), and the log gets one line for them all."""
        cut = list(self._live)
        logger.warning(
            f"shutting down: the grace period of {self._grace_s:g} s is over; stopping {len(cut)} unfinished "
            "request(s), each told so"
        )
        for request_id in cut:
            self._end(request_id, "abort", cut=True)

    def _command(self, kind: str, *args) -> None:
        if kind == "close":
            if self._deadline is None or args[0] < self._deadline:
                self._deadline, self._grace_s = args
        elif kind == "abort":
            if args[0] in self._live:
                self._end(args[0], "abort")
        else:
            handle, prompt, params, stop = args
            try:
                self.engine.add_request(prompt, params, request_id=handle.request_id)
            except (ValueError, TypeError) as error:
                self._release_slot()
                handle.emit(Event("failed", error=error))
                return
            text = IncrementalText(self.tokenizer, stop) if self.tokenizer is not None else None
            self._live[handle.request_id] = _Live(handle, text, len(prompt))
            handle.emit(Event("accepted", prompt_tokens=len(prompt)))

    def _deliver(self, output) -> None:
        live = self._live.get(output.request_id)
        if live is None:  # ended already (stop string, abort): its final engine output carries nothing new
            return
        if live.text is None:  # nothing to detokenize: tokens are only counted
            live.tokens += len(output.new_tokens)
            if output.finished:
                self._end(output.request_id, output.finish_reason, output.request)
            return
        pieces = []
        for token in output.new_tokens:
            pieces.append(live.text.push(token))
            if live.text.stopped:
                break
        if live.text.stopped:
            reason = "stop"
        elif output.finished:
            reason = output.finish_reason
            pieces.append(live.text.finish())
        else:
            reason = None
        if any(pieces):
            live.handle.emit(Event("text", text="".join(pieces)))
        if reason is not None:
            self._end(output.request_id, reason, output.request)

    def _end(self, request_id: str, reason: str, request=None, cut: bool = False) -> None:
        """Close a live request: abort it in the engine unless ``request`` is the one its final output carried, and
        send its final event ("failed" with ``ShuttingDown`` when ``cut`` by the shutdown's deadline)."""
        live = self._live.pop(request_id)
        if request is None:
            request = self.engine.requests[request_id]
            self.engine.abort(request_id)
        if self.learner is not None:
            self.learner.request_ended(request)
        self.stats.add_request(reason, request.verify_rounds, request.accepted)
        self._release_slot()
        extra = {
            "verify_rounds": request.verify_rounds,
            "accepted_drafts": request.accepted,
            "drafter_version": int(getattr(self.engine.drafter, "weights_version", 0) or 0),
        }
        if cut:
            error = ShuttingDown(
                f"server: shutting down, and the grace period of {self._grace_s:g} s ended before this request "
                f"finished (stopped after {live.tokens_used} tokens)"
            )
            live.handle.emit(Event("failed", error=error, extra=extra))
            return
        live.handle.emit(
            Event(
                "finished",
                finish_reason=reason,
                prompt_tokens=live.prompt_tokens,
                completion_tokens=live.tokens_used,
                extra=extra,
            )
        )

    def _release_slot(self) -> None:
        with self._lock:
            self._accepted -= 1
