"""The engine thread: one loop serves requests submitted from other threads (Triton's `execute`).

Submitting only enqueues; the loop admits requests, polls client cancellation, runs `step()`, applies
stop strings and hands each output to its submission's `emit` callback, in order. Every submission
ends exactly once: with a finished output through `emit`, or through `fail` (not admitted, engine
died, shutdown). If the loop dies, it fails everything in flight and `alive` turns False.

`emit`, `fail` and every one of the observer's hooks run on a second thread, the output thread, in the order
the loop queued them, but that a request's first output goes ahead of what is queued (`_queue`); an observer
never sees two calls at once (Triton's custom metrics must not: backend/triton/metrics.py). A Triton
response send is a synchronous round trip to the server process (and each metric update another), ~0.4 ms
of which the output thread spends ~0.15 ms on a CPU. Where the engine leaves a CPU free, the output thread
sends a step's outputs while the next step runs. Where the forward's threads take every CPU
(`LLMEngine.fills_the_cpus`), the loop waits for the output thread to finish a step's outputs and observer hooks
before the next step, and polls the clients' cancellations meanwhile. The hooks too: queued after the wait, the
step's metric updates ran beside the next forward, whose threads hold the CPUs and the GIL between ops, and took
2.7 ms there against 0.2 ms between steps, stretching the step from 8.1 to 10.8 ms (SmolLM2 at one stream, Zen 3,
2026-12-03). Measured on 2 CPUs with 2 OpenMP threads (SmolLM2-135M, 40 streams), sending beside a step
stretched a 40-sequence decode step from 112 to 130-140 ms, since every wake-up of the output thread, the server
and the stub's IPC thread lands on a CPU an OpenMP thread needs; waiting costs ~17 ms a step instead (README,
Benchmarks: 2-5 % more tokens per second served). With
one OpenMP thread on the same 2 CPUs, sending beside the step served ~2 % more than waiting.
The sends stay on one thread. Spread over four (each request's outputs on one of them, the metric updates
under a lock), the sends and cancellation polls after a 40-sequence step took as long as on one (~16 ms): a
send then took 0.68 ms instead of 0.24 (median; measured 2026-11-23, same machine), so the responses are
delivered one at a time further on, in the server process, whose work and the client's share the 2 CPUs.
It also reports the loop's heartbeat about once a second (`LoopObserver.on_heartbeat`): the time the loop
last went round idle or after a step that did work. It stands still while a step runs, and while the loop goes
round with work that no step takes (a scheduler that admits nothing), and turns -1 once the loop has died, so
a supervisor outside the process tells a dead or wedged engine from a busy one.

The loop thread also builds the engine, so every OpenMP parallel region of the process starts from this
one thread. Each thread that starts one gets its own libgomp worker pool, and once a process has more
pool threads than CPUs, libgomp cuts its barrier spin from ~300,000 to 100 iterations: every region then
ends in a futex sleep and wake. An engine built (weights, kernel, warm-up) on Triton's thread and run on
this one lost 12-17 % of its throughput to that, with 1.65 of 2 CPUs busy.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backend.serving.detokenize import IncrementalDetokenizer
from backend.engine.engine import EngineStats, LLMEngine, RequestOutput
from backend.engine.errors import EngineDeadError, QueueFullError
from backend.engine.kv_events import KVEvent
from backend.engine.kv_transfer import ExportedKV
from backend.serving.request import GenerationRequest
from backend.engine.sequence import FinishReason

LOG = logging.getLogger(__name__)
HEARTBEAT_S = 1.0
CANCEL_POLL_S = 0.05  # how often the loop asks the clients whether they cancelled, at most
FIRST, REST, LAST = 1, 2, 3  # the output thread's lanes, in the order it serves them


@dataclass
class Submission:
    client_id: str  # the caller's request id (may repeat, may be empty); `stop` targets it
    request: GenerationRequest
    emit: Callable[[RequestOutput], None]
    fail: Callable[[Exception], None]
    is_cancelled: Callable[[], bool] = lambda: False
    submitted_at: float = field(default_factory=time.monotonic)
    engine_id: str = ""
    last_token_at: float | None = None  # for the inter-token latency metric
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)  # per sample, for stop strings
    # stream_interval: per sample, its outputs merged since its last send and how many; the samples that sent one
    held: dict[int, tuple[RequestOutput, int]] = field(default_factory=dict)
    started: set[int] = field(default_factory=set)
    # a prefill worker's hook: called (output thread) with the prompt's K/V before the final output
    on_kv_export: Callable[[ExportedKV], None] | None = None


class LoopObserver:
    """Hooks for metrics, called on the output thread; the default does nothing."""

    def on_step(self, stats: EngineStats, step_seconds: float) -> None: ...

    def on_refused(self, reason: str) -> None:
        """A request was not admitted: "overloaded" (the waiting queue is full) or "invalid"."""

    def on_idle(self, stats: EngineStats) -> None:
        """The engine has no request left (the last one finished or was aborted between steps)."""

    def on_first_token(self, seconds: float) -> None: ...

    def on_token_interval(self, seconds: float) -> None: ...

    def on_finished(self, num_prompt_tokens: int, num_output_tokens: int) -> None: ...

    def on_kv_events(self, events: list[KVEvent]) -> None:
        """Prefix-cache stores and evictions of one step, in order (only with `enable_kv_events`)."""

    def on_heartbeat(self, last_round: float) -> None:
        """About once a second: the Unix time the loop last went round idle or after a step that did work
        (the module docstring); -1 once it has died."""


class EngineLoop:
    def __init__(self, make_engine: Callable[[], LLMEngine], tokenizer=None,
                 observer: LoopObserver | None = None, overlap_outputs: bool | None = None):
        """`overlap_outputs`: send a step's outputs while the next step runs; None: unless the engine fills the
        CPUs (the module docstring)."""
        self._make_engine = make_engine
        self.overlap_outputs = overlap_outputs
        self.engine: LLMEngine | None = None  # built by the loop thread
        self.tokenizer = tokenizer  # needed for stop strings
        self.observer = observer or LoopObserver()
        self.error: BaseException | None = None
        self.last_round = 0.0  # Unix time the loop last went round idle or after a step that did work
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._deferred: list[tuple[str, object]] = []  # inbox items taken inside a step, handled after it
        self._active: dict[str, Submission] = {}
        self._cancel_polled_at = 0.0  # time.monotonic() the clients were last asked whether they cancelled
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._built = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # (lane, order, task): a request's first output (lane FIRST) goes ahead of what is queued (lane REST)
        self._outbox: queue.PriorityQueue[tuple[int, int, Callable[[], None] | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._output_thread = threading.Thread(target=self._send_outputs, name="engine-output", daemon=True)

    def start(self) -> "EngineLoop":
        """Start the thread and wait until it has built the engine; a build error is raised here."""
        self._output_thread.start()
        self._thread.start()
        self._built.wait()
        if self.engine is None:
            raise EngineDeadError(f"building the engine failed: {self.error!r}") from self.error
        # the first heartbeat, before the server reports ready, from the thread that sends all the others
        self.last_round = time.time()
        self._queue(functools.partial(self.observer.on_heartbeat, self.last_round), FIRST)
        self._marker().wait()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, sub: Submission) -> None:
        """Queue a submission (also before start(): it is admitted by the loop's first iteration)."""
        if self.error is not None or self._stopping.is_set():
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        self._inbox.put(("add", sub))

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the loop thread between steps (an engine is single-threaded: LLMEngine.load_lora, say);
        its result or error comes in the future."""
        if self.error is not None or self._stopping.is_set():
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (fn, future)))
        return future

    def stop_request(self, client_id: str) -> None:
        """Abort every in-flight request with this client id (TensorRT-LLM's `stop`)."""
        self._inbox.put(("stop", client_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._outbox.put((LAST, next(self._order), None))  # after everything queued before it
        self._output_thread.join(timeout)

    @property
    def num_active(self) -> int:
        return len(self._active)

    # -- the loop -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._make_engine()
        except BaseException as err:  # noqa: BLE001 - start() raises it
            self.error = err
            self._fail_all(EngineDeadError(f"building the engine failed: {err!r}"))
            return
        finally:
            self._built.set()
        if self.overlap_outputs is None:
            self.overlap_outputs = not self.engine.fills_the_cpus
        busy = False
        progressed = True
        try:
            while not self._stopping.is_set():
                if progressed:
                    self.last_round = time.time()
                self._drain_inbox(block=not self.engine.has_unfinished())
                if busy and not self.engine.has_unfinished():  # an abort frees blocks without a step
                    busy = False
                    self._queue(functools.partial(self.observer.on_idle, self.engine.stats()))
                progressed = True  # idle
                if self.engine.has_unfinished():
                    busy = True
                    start = time.monotonic()
                    outputs = self.engine.step(self._between_layers)
                    for out in outputs:
                        self._dispatch(out)
                    self._poll_cancellations()  # round trips too: while the output thread sends
                    if events := self.engine.kv.take_events():
                        self._queue(functools.partial(self.observer.on_kv_events, events))
                    stats = self.engine.stats()
                    progressed = bool(outputs or stats.last_step_tokens)
                    self._queue(functools.partial(self.observer.on_step, stats, time.monotonic() - start))
                    if not self.overlap_outputs:
                        self._marker().wait()  # the step's observer hooks too, not only its sends
        except BaseException as err:  # noqa: BLE001 - a dead loop must be loud and fail its requests
            LOG.exception("engine loop died")
            self.error = err
            self._fail_all(EngineDeadError(f"the engine failed: {err!r}"))

    def _drain_inbox(self, block: bool) -> None:
        for item in self._deferred:
            self._handle(*item)
        self._deferred.clear()
        try:
            item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
            while True:
                self._handle(*item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _between_layers(self) -> None:
        """Inside a step, between the model's layers: new requests are admitted, and one whose tenant runs below
        its fair share may cut in (LLMEngine.cut_in) and get its first token now. Everything else waits for the
        step's end: an abort would free blocks the step in flight still writes."""
        if self._inbox.empty():
            return
        admitted = False
        try:
            while True:
                kind, payload = self._inbox.get_nowait()
                if kind == "add":
                    self._admit(payload)
                    admitted = True
                else:
                    self._deferred.append((kind, payload))
        except queue.Empty:
            pass
        if admitted:
            for out in self.engine.cut_in():
                self._dispatch(out)

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            self._admit(payload)
        elif kind == "stop":
            for sub in [s for s in self._active.values() if s.client_id == payload]:
                self._abort(sub.engine_id)
        elif kind == "abort":  # its output could not be sent
            self._abort(payload)
        elif kind == "call":
            fn, future = payload
            try:
                future.set_result(fn(self.engine))
            except Exception as err:  # noqa: BLE001 - the caller's error
                future.set_exception(err)

    def _abort(self, engine_id: str) -> None:
        """Abort once: a client's cancel, a `stop` and a failed send may all name the same request, and an
        aborted request stays active until the next step delivers its final output."""
        if self.engine.has_request(engine_id):
            self.engine.abort(engine_id)

    def _admit(self, sub: Submission) -> None:
        sub.engine_id = f"{sub.client_id}#{next(self._ids)}"
        req = sub.request
        try:
            if req.kv is not None:  # a remote prefill's blocks: the request finds them as cached prefix
                self.engine.import_kv(req.prompt_token_ids, req.kv, self.engine.cache_salt(req.tenant, req.cache_salt))
            lora = req.lora_name if req.lora_task_id is None else self.engine.lora_of_task(req.lora_task_id)
            self.engine.add_request(sub.engine_id, req.prompt_token_ids, req.params, req.priority, req.tenant,
                                    req.cache_salt, lora)
        except Exception as err:  # noqa: BLE001 - invalid or overloaded: this request's error
            reason = "overloaded" if isinstance(err, QueueFullError) else "invalid"
            self._queue(functools.partial(self.observer.on_refused, reason), FIRST)
            self._queue(functools.partial(_safe_fail, sub, err), FIRST)
            return
        self._active[sub.engine_id] = sub

    def _poll_cancellations(self) -> None:
        """Clients that went away are aborted (asked every CANCEL_POLL_S: each ask is a round trip to the server
        process, 0.3-0.6 ms of a one-stream step's serial time on the Zen 3); requests past their deadline end with
        what they have."""
        now = time.monotonic()
        ask = now - self._cancel_polled_at >= CANCEL_POLL_S
        if ask:
            self._cancel_polled_at = now
        for sub in list(self._active.values()):
            if ask and sub.is_cancelled():
                self._abort(sub.engine_id)
            elif sub.request.timeout_ms and now - sub.submitted_at >= sub.request.timeout_ms / 1e3 \
                    and self.engine.has_request(sub.engine_id):
                for out in self.engine.end(sub.engine_id, FinishReason.TIMEOUT):
                    self._dispatch(out)

    def _dispatch(self, out: RequestOutput) -> None:
        sub = self._active.get(out.request_id)
        if sub is None:
            return
        lane = FIRST if sub.last_token_at is None else REST
        if out.error is not None:  # failed after admission (guided_decoding.py): an error, as a refusal is
            del self._active[out.request_id]
            self._abort(out.request_id)  # its other samples
            self._queue(functools.partial(self.observer.on_refused, "invalid"), lane)
            self._queue(functools.partial(_safe_fail, sub, out.error), lane)
            return
        if sub.request.stop_strings and (end := self._stop_string_end(sub, out)) is not None \
                and (not out.finished or end < len(out.new_token_ids)):
            # the tokens after the one that completes it were generated past it (speculation yields several a step)
            finished = out.request_finished if out.finished else self.engine.finish(
                self.engine.sample_id(sub.engine_id, out.index), FinishReason.STOP).request_finished
            out = dataclasses.replace(out, new_token_ids=out.new_token_ids[:end], new_logprobs=out.new_logprobs[:end],
                                      new_top_logprobs=out.new_top_logprobs[:end], finished=True,
                                      finish_reason=FinishReason.STOP.value, request_finished=finished,
                                      num_output_tokens=out.num_output_tokens - len(out.new_token_ids) + end)
        now = time.monotonic()
        if out.new_token_ids:
            if sub.last_token_at is None:
                self._queue(functools.partial(self.observer.on_first_token, now - sub.submitted_at), lane)
            else:
                self._queue(functools.partial(self.observer.on_token_interval, now - sub.last_token_at), lane)
            sub.last_token_at = now
        if out.finished:
            self._queue(functools.partial(self.observer.on_finished, out.num_prompt_tokens,
                                          out.num_output_tokens), lane)
        if out.request_finished:
            del self._active[out.request_id]
            if sub.on_kv_export is not None and out.finish_reason != FinishReason.CANCELLED.value:
                # now, before any later step can evict the prompt's blocks from the prefix cache
                req = sub.request
                kv = self.engine.export_kv(req.prompt_token_ids, self.engine.cache_salt(req.tenant, req.cache_salt))
                self._queue(functools.partial(sub.on_kv_export, kv), lane)
        if (out := self._hold(sub, out)) is not None:
            self._queue(functools.partial(self._emit, sub, out), lane)

    def _hold(self, sub: Submission, out: RequestOutput) -> RequestOutput | None:
        """stream_interval N: after a sample's first output, its outputs are merged and sent every N steps (one
        response, one send, instead of N), and at once when it finishes; None while this one is held. The tokens
        are the same, stop strings have been applied, and the metrics above counted each step."""
        interval = sub.request.stream_interval or self.engine.config.stream_interval
        pending, count = sub.held.pop(out.index, (None, 0))
        if pending is not None:
            out = dataclasses.replace(out, new_token_ids=pending.new_token_ids + out.new_token_ids,
                                      new_logprobs=pending.new_logprobs + out.new_logprobs,
                                      new_top_logprobs=pending.new_top_logprobs + out.new_top_logprobs,
                                      prompt_logprobs=pending.prompt_logprobs or out.prompt_logprobs)
        if out.finished or out.index not in sub.started or count + 1 >= interval:
            sub.started.add(out.index)
            return out
        sub.held[out.index] = (out, count + 1)
        return None

    def _queue(self, task: Callable[[], None], lane: int = REST) -> None:
        """For the output thread. A request's first output takes lane FIRST, ahead of the REST queued before it
        (its own later outputs come after it either way): after a step that ends or feeds many streams the
        output thread has tens of sends and metric updates queued, each a round trip to the server process
        (measured: 51 tasks, 124 ms, ahead of a light tenant's first token that had cut into the step). The
        metrics a request's output implies (a refusal, its TTFT, its token counts) take that output's lane, queued
        before it: a client that has its answer finds the metrics counting it."""
        self._outbox.put((lane, next(self._order), task))

    def _marker(self) -> threading.Event:
        """An event the output thread sets once it has run everything queued before it."""
        done = threading.Event()
        self._queue(done.set, LAST)
        return done

    def _emit(self, sub: Submission, out: RequestOutput) -> None:
        try:
            sub.emit(out)
        except Exception:  # noqa: BLE001 - e.g. the client is gone: drop the request, keep serving
            LOG.exception("sending output of %s failed; aborting it", sub.engine_id)
            if not out.request_finished:
                self._inbox.put(("abort", sub.engine_id))

    def _send_outputs(self) -> None:
        """The output thread: runs what the loop queued, in order, until shutdown's sentinel; between tasks,
        the heartbeat."""
        beat_at = 0.0
        while True:
            try:
                _, _, task = self._outbox.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                task = _no_task
            if task is None:
                return
            try:
                task()
                if self._built.is_set() and time.monotonic() - beat_at >= HEARTBEAT_S:
                    beat_at = time.monotonic()
                    self.observer.on_heartbeat(self.last_round if self.alive else -1.0)
            except Exception:  # noqa: BLE001 - an observer's error must not stop the outputs
                LOG.exception("output thread task failed")

    def _stop_string_end(self, sub: Submission, out: RequestOutput) -> int | None:
        """How many of the output's new tokens reach the end of a stop string (the first that completes one), None
        when none does."""
        detok = sub.detokenizers.get(out.index) or sub.detokenizers.setdefault(
            out.index, IncrementalDetokenizer(self.tokenizer))
        longest = max(map(len, sub.request.stop_strings))
        for end, token in enumerate(out.new_token_ids, 1):
            piece = detok.push([token])
            window = detok.text[-(len(piece) + longest - 1):] if piece else ""
            if any(stop in window for stop in sub.request.stop_strings):
                return end
        return None

    def _fail_all(self, err: Exception) -> None:
        while True:  # submissions still in the inbox
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._queue(functools.partial(_safe_fail, payload, err))
            elif kind == "call":
                payload[1].set_exception(err)
        for engine_id, sub in list(self._active.items()):
            del self._active[engine_id]
            self._queue(functools.partial(_safe_fail, sub, err))


def _no_task() -> None: ...


def _safe_fail(sub: Submission, err: Exception) -> None:
    try:
        sub.fail(err)
    except Exception:  # noqa: BLE001 - nothing more can be done for this request
        LOG.exception("sending the error of %s failed", sub.engine_id or sub.client_id)
