"""The engine thread: ordering, exactly one end per request, stop by client id, stop strings, death."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from backend.serving.detokenize import decode_text
from backend.engine import EngineConfig, LLMEngine
from backend.serving.engine_thread import EngineDeadError, EngineLoop, LoopObserver, Submission
from backend.serving.request import GenerationRequest
from backend.engine.sampling import SamplingParams
from backend.engine.scheduler import SchedulerOutput
from backend.serving.tokenizer import load_tokenizer
from backend.engine.runners.torch_runner import TorchRunner

PROMPT = list(range(200, 230))


class Recorder:
    """Collects what a submission receives; `done` is set on its one and only end."""

    def __init__(self):
        self.tokens: list[int] = []
        self.reasons: list[str | None] = []
        self.errors: list[Exception] = []
        self.ends = 0
        self.done = threading.Event()

    def emit(self, out) -> None:
        self.tokens += out.new_token_ids
        if out.finished:
            self.reasons.append(out.finish_reason)
            self._end()

    def fail(self, err: Exception) -> None:
        self.errors.append(err)
        self._end()

    def _end(self) -> None:
        self.ends += 1
        self.done.set()


def submit(loop: EngineLoop, client_id: str = "c", max_tokens: int = 8, **request) -> Recorder:
    rec = Recorder()
    req = GenerationRequest(PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True), stream=True, **request)
    loop.submit(Submission(client_id, req, rec.emit, rec.fail))
    return rec


@pytest.fixture(params=[True, False], ids=["overlap", "wait"])
def loop(tiny_model_dir, request):
    """A loop that sends a step's outputs while the next step runs, and one that waits for them first."""
    config = EngineConfig.create(model=str(tiny_model_dir))
    loop = EngineLoop(lambda: LLMEngine(config), load_tokenizer(tiny_model_dir), overlap_outputs=request.param).start()
    yield loop
    loop.shutdown()


def test_requests_stream_in_order_and_end_once(loop, tiny_model_dir):
    expected = LLMEngine(EngineConfig.create(model=str(tiny_model_dir))).generate(
        [PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    recs = [submit(loop, f"c{i}") for i in range(5)]
    for rec in recs:
        assert rec.done.wait(30)
        assert rec.tokens == expected and rec.reasons == ["length"] and rec.ends == 1
    assert loop.num_active == 0 and loop.engine.kv.num_used_blocks == 0


def test_stop_by_client_id_cancels_every_request_with_it(tiny_model_dir):
    loop = EngineLoop(lambda: LLMEngine(EngineConfig.create(model=str(tiny_model_dir))))
    # queued before the loop runs, so the stop lands before any of them can finish, however loaded the machine
    a, b, other = submit(loop, "x", max_tokens=500), submit(loop, "x", max_tokens=500), submit(loop, "y", 6)
    loop.stop_request("x")
    loop.start()
    for rec in (a, b, other):
        assert rec.done.wait(60) and rec.ends == 1
    assert a.reasons == b.reasons == ["cancelled"] and other.reasons == ["length"]
    loop.shutdown()


def test_client_cancellation_is_polled(loop):
    cancelled = threading.Event()
    rec = Recorder()
    req = GenerationRequest(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True), stream=True)
    loop.submit(Submission("c", req, rec.emit, rec.fail, is_cancelled=cancelled.is_set))
    cancelled.set()
    assert rec.done.wait(30) and rec.reasons == ["cancelled"] and len(rec.tokens) < 500
    assert loop.engine.kv.num_used_blocks == 0


def test_a_request_cancelled_twice_ends_once_and_the_loop_lives(loop):
    """A client's cancel and a `stop` for the same request in one loop iteration (Dynamo sends both when a
    client disconnects): the second must not abort a request the first already ended."""
    for i in range(10):
        cancelled, rec = threading.Event(), Recorder()
        first = threading.Event()
        req = GenerationRequest(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True), stream=True)

        def emit(out, rec=rec, first=first):
            rec.emit(out)
            first.set()

        loop.submit(Submission(f"c{i}", req, emit, rec.fail, is_cancelled=cancelled.is_set))
        assert first.wait(30)
        cancelled.set()
        loop.stop_request(f"c{i}")
        assert rec.done.wait(30) and rec.reasons == ["cancelled"] and rec.ends == 1
        assert loop.alive, loop.error
    time.sleep(0.2)
    assert loop.engine.kv.num_used_blocks == 0 and loop.num_active == 0


def test_a_request_past_its_deadline_ends_with_what_it_has(loop):
    rec = submit(loop, max_tokens=900, timeout_ms=300)
    assert rec.done.wait(30) and rec.reasons == ["timeout"] and rec.ends == 1
    assert 0 < len(rec.tokens) < 900  # it ran, and was cut
    time.sleep(0.2)
    assert loop.engine.kv.num_used_blocks == 0 and loop.alive


def test_stop_string_ends_generation(loop, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    full = submit(loop, max_tokens=16)
    assert full.done.wait(30)
    text = decode_text(tokenizer, full.tokens)
    stop = text[6:9]
    rec = submit(loop, max_tokens=16, stop_strings=[stop])
    assert rec.done.wait(30) and rec.reasons == ["stop"]
    got = decode_text(tokenizer, rec.tokens)
    assert stop in got and text.startswith(got) and len(rec.tokens) < 16


def test_invalid_request_fails_alone(loop):
    bad = Recorder()
    loop.submit(Submission("bad", GenerationRequest([], SamplingParams()), bad.emit, bad.fail))
    good = submit(loop)
    assert bad.done.wait(30) and "prompt_token_ids" in str(bad.errors[0])
    assert good.done.wait(30) and good.reasons == ["length"]


class FailingRunner:
    """The real runner, failing on a chosen call: what a runtime error in a forward looks like."""

    def __init__(self, inner: TorchRunner, fail_at: int):
        self.inner, self.fail_at, self.calls = inner, fail_at, 0
        self.model_config, self.num_blocks, self.block_size = inner.model_config, inner.num_blocks, inner.block_size

    def forward(self, batch, between_layers=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected forward failure")
        return self.inner.forward(batch, between_layers)


def test_a_dead_engine_fails_in_flight_requests_and_refuses_new_ones(tiny_model_dir):
    config = EngineConfig.create(model=str(tiny_model_dir), num_kv_blocks=256)
    runner = FailingRunner(TorchRunner(config.model, config.dtype, 256, config.cache.block_size), fail_at=3)
    loop = EngineLoop(lambda: LLMEngine(config, runner=runner))
    recs = [submit(loop, f"c{i}", max_tokens=50) for i in range(3)]  # all in flight when step 3 fails
    loop.start()
    for rec in recs:
        assert rec.done.wait(60) and rec.ends == 1
        assert rec.errors and "injected forward failure" in str(rec.errors[0])
    assert not loop.alive
    with pytest.raises(EngineDeadError, match="not running"):
        submit(loop)
    loop.shutdown()


class ArrivalDuringStep:
    """The real runner; in its forward number `at`, after the first layer, `arrive()` runs: what a request that
    Triton's thread submits while that step is in flight looks like to the loop."""

    def __init__(self, inner: TorchRunner, at: int, arrive):
        self.inner, self.at, self.arrive, self.calls = inner, at, arrive, 0
        self.model_config, self.num_blocks, self.block_size = inner.model_config, inner.num_blocks, inner.block_size

    def forward(self, batch, between_layers=None):
        self.calls += 1
        if self.calls != self.at:
            return self.inner.forward(batch, between_layers)
        arrived = []

        def arrive_then(between=between_layers) -> None:
            if not arrived:
                arrived.append(self.arrive())
            between()

        return self.inner.forward(batch, arrive_then)


def test_a_light_tenant_arriving_mid_step_gets_its_first_token_before_that_step_ends(tiny_model_dir):
    config = EngineConfig.create(model=str(tiny_model_dir), max_num_seqs=8)
    expected = LLMEngine(config).generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    emitted: list[tuple[str, int]] = []  # (client, its tokens so far), in the order the output thread sends them
    recs: dict[str, Recorder] = {}

    def submit_logged(client: str, tenant: str) -> None:
        rec = recs[client] = Recorder()

        def emit(out) -> None:
            rec.emit(out)
            emitted.append((client, len(rec.tokens)))

        req = GenerationRequest(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True), stream=True, tenant=tenant)
        loop.submit(Submission(client, req, emit, rec.fail))

    def arrive() -> None:  # a's third step (its second decode) is in flight
        submit_logged("b", "b")
        loop.stop_request("a0")  # waits for the step's end: the step in flight still writes a0's blocks

    runner = ArrivalDuringStep(TorchRunner(config.model, config.dtype, 256, config.cache.block_size), 3, arrive)
    loop = EngineLoop(lambda: LLMEngine(config, runner=runner))
    for i in range(6):  # queued before the loop runs: one prefill step for all six
        submit_logged(f"a{i}", "a")
    loop.start()
    for client in [f"a{i}" for i in range(6)] + ["b"]:  # b arrives while the a's run
        assert recs[client].done.wait(60) and recs[client].ends == 1
    first_b = emitted.index(("b", 1))
    assert {n for client, n in emitted[:first_b] if client != "b"} == {1, 2}  # before a's third token
    assert recs["b"].tokens == expected and recs["b"].reasons == ["length"]
    assert recs["a0"].tokens == expected[:3] and recs["a0"].reasons == ["cancelled"]
    assert all(recs[f"a{i}"].tokens == expected for i in range(1, 6))
    assert loop.num_active == 0 and loop.engine.kv.num_used_blocks == 0
    loop.shutdown()


def submit_logged(loop: EngineLoop, client: str, sent: list, gate: threading.Event | None = None) -> Recorder:
    """A 40-token stream whose sends are logged in `sent` as (client, tokens so far); with a `gate`, its first send
    waits for it, holding the output thread while the stream's next tokens queue up behind."""
    rec = Recorder()

    def emit(out) -> None:
        if gate is not None and not rec.tokens:
            gate.wait(30)
        rec.emit(out)
        sent.append((client, len(rec.tokens)))

    req = GenerationRequest(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True), stream=True)
    loop.submit(Submission(client, req, emit, rec.fail))
    return rec


def engine_sequence(loop: EngineLoop, client: str, min_tokens: int, deadline: float):
    """The engine's sequence of the client's request, once it has at least `min_tokens` output tokens."""
    while not (seqs := [s for rid, s in list(loop.engine.requests.items()) if rid.startswith(client + "#")]) \
            or len(seqs[0].output_token_ids) < min_tokens:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return seqs[0]


@pytest.mark.parametrize("loop", [True], ids=["overlap"], indirect=True)  # the engine steps on beside the held send
def test_a_first_output_goes_ahead_of_the_outputs_queued_before_it(loop):
    """The output thread is held inside a's first send while a's next tokens queue up behind it; b's first token,
    queued after them, is sent before them. Each request's own outputs stay in order."""
    gate, sent = threading.Event(), []
    a = submit_logged(loop, "a", sent, gate)
    deadline = time.monotonic() + 30
    engine_sequence(loop, "a", 3, deadline)
    b = submit_logged(loop, "b", sent)
    engine_sequence(loop, "b", 1, deadline)
    gate.set()
    assert a.done.wait(30) and b.done.wait(30) and a.ends == b.ends == 1
    assert sent[:2] == [("a", 1), ("b", 1)] and ("a", 2) in sent
    assert [n for client, n in sent if client == "a"] == list(range(1, 41))
    assert [n for client, n in sent if client == "b"] == list(range(1, 41))


class Reported(LoopObserver):
    """What the loop reports to its observer: heartbeats and refusals."""

    def __init__(self):
        self.beats: list[float] = []
        self.refused: list[str] = []

    def on_heartbeat(self, last_round: float) -> None:
        self.beats.append(last_round)

    def on_refused(self, reason: str) -> None:
        self.refused.append(reason)


def test_the_heartbeat_goes_on_while_idle_and_turns_negative_when_the_loop_dies(tiny_model_dir):
    config = EngineConfig.create(model=str(tiny_model_dir), num_kv_blocks=256)
    runner = FailingRunner(TorchRunner(config.model, config.dtype, 256, config.cache.block_size), fail_at=3)
    observer = Reported()
    loop = EngineLoop(lambda: LLMEngine(config, runner=runner), observer=observer).start()
    assert observer.beats and observer.beats[0] > 0  # one before start() returns, i.e. before Triton's ready
    time.sleep(2.5)
    idle = list(observer.beats)
    assert len(idle) >= 3 and idle == sorted(idle) and time.time() - idle[-1] < 1.5
    assert submit(loop, max_tokens=50).done.wait(60)  # fails at the third step
    deadline = time.monotonic() + 5
    while observer.beats[-1] != -1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert observer.beats[-1] == -1 and not loop.alive
    loop.shutdown()


def test_the_engine_is_built_on_the_loop_thread(tiny_model_dir):
    """One OpenMP master for every forward (see backend/serving/engine_thread.py): build and steps share a thread."""
    threads: list[str] = []

    def build() -> LLMEngine:
        threads.append(threading.current_thread().name)
        return LLMEngine(EngineConfig.create(model=str(tiny_model_dir)))

    loop = EngineLoop(build).start()
    assert threads == ["engine-loop"] and loop.engine is not None and loop.alive
    assert submit(loop).done.wait(30)
    loop.shutdown()


def test_a_failed_build_raises_from_start_and_fails_queued_requests(tiny_model_dir):
    def build() -> LLMEngine:
        return LLMEngine(EngineConfig.create(model=str(tiny_model_dir), dtype="float8"))

    loop = EngineLoop(build)
    queued = submit(loop)
    with pytest.raises(EngineDeadError, match="building the engine failed.*float8"):
        loop.start()
    assert queued.done.wait(5) and queued.ends == 1 and "float8" in str(queued.errors[0])
    assert not loop.alive
    with pytest.raises(EngineDeadError, match="not running"):
        submit(loop)


def test_outputs_leave_on_the_output_thread_in_order(loop):
    """emit runs on the output thread, so a slow send (a server round trip) never holds up a step."""
    threads: set[str] = set()
    rec = Recorder()

    def emit(out) -> None:
        threads.add(threading.current_thread().name)
        rec.emit(out)

    req = GenerationRequest(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True), stream=True)
    loop.submit(Submission("c", req, emit, rec.fail))
    assert rec.done.wait(30) and len(rec.tokens) == 12 and rec.reasons == ["length"]
    assert threads == {"engine-output"}


def test_a_request_whose_output_cannot_be_sent_is_aborted(loop):
    sends = []

    def emit(out) -> None:
        sends.append(out.finished)
        raise ConnectionError("client gone")

    req = GenerationRequest(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True), stream=True)
    loop.submit(Submission("gone", req, emit, lambda err: None))
    other = submit(loop, "other")
    assert other.done.wait(30) and other.reasons == ["length"]
    for _ in range(300):  # the abort reaches the engine through the loop's inbox
        if sends and sends[-1]:
            break
        time.sleep(0.1)
    assert sends[-1] and len(sends) < 500  # cancelled long before max_tokens, final output attempted
    assert loop.num_active == 0 and loop.engine.kv.num_used_blocks == 0


def test_the_heartbeat_stands_still_while_work_waits_that_no_step_takes(tiny_model_dir):
    """A loop that goes round but schedules nothing for a waiting request is wedged too: its heartbeat must not
    tell the supervisor otherwise. The scheduler is made to admit nothing, then let go."""
    config = EngineConfig.create(model=str(tiny_model_dir), num_kv_blocks=256)
    observer = Reported()
    loop = EngineLoop(lambda: LLMEngine(config), observer=observer).start()
    scheduler = loop.engine.scheduler
    admit = scheduler.schedule
    scheduler.schedule = lambda: SchedulerOutput([], [])
    rec = submit(loop, max_tokens=4)
    time.sleep(0.5)
    stuck_at = observer.beats[-1]
    time.sleep(2.5)
    assert loop.alive and not rec.done.is_set() and observer.beats[-1] == stuck_at
    scheduler.schedule = admit
    assert rec.done.wait(30)
    deadline = time.monotonic() + 5
    while observer.beats[-1] <= stuck_at and time.monotonic() < deadline:
        time.sleep(0.1)
    assert observer.beats[-1] > stuck_at
    loop.shutdown()


def test_a_refusal_is_counted_before_its_client_hears_of_it(tiny_model_dir):
    """A refusal goes ahead of the outputs queued before it (the first-output lane), and its metric with it: a
    client that got 'overloaded' and reads the metrics finds itself counted (the server test does just that).
    The output thread is held in a's first send while a's next tokens queue; then b is refused."""
    observer = Reported()
    loop = EngineLoop(lambda: LLMEngine(EngineConfig.create(model=str(tiny_model_dir))), observer=observer,
                      overlap_outputs=True).start()
    gate, sent = threading.Event(), []
    held = submit_logged(loop, "a", sent, gate)
    deadline = time.monotonic() + 30
    a = engine_sequence(loop, "a", 3, deadline)
    refused = Recorder()

    def fail(err: Exception) -> None:
        sent.append(("b refused", list(observer.refused)))
        refused.fail(err)

    n = len(a.output_token_ids)
    loop.submit(Submission("b", GenerationRequest(PROMPT, SamplingParams(max_tokens=10**7), stream=True),
                           refused.emit, fail))
    while len(a.output_token_ids) < n + 2:  # the loop has gone round since: b's refusal is queued
        assert time.monotonic() < deadline
        time.sleep(0.001)
    gate.set()
    assert held.done.wait(30) and refused.done.wait(30)
    assert sent[:2] == [("a", 1), ("b refused", ["invalid"])], sent[:3]
    loop.shutdown()


class Threads(LoopObserver):
    """The thread each of the observer's hooks was called on, by hook."""

    def __init__(self):
        self.seen: dict[str, set[str]] = {}

    def _saw(self, hook: str) -> None:
        self.seen.setdefault(hook, set()).add(threading.current_thread().name)

    def on_step(self, stats, step_seconds): self._saw("on_step")
    def on_refused(self, reason): self._saw("on_refused")
    def on_idle(self, stats): self._saw("on_idle")
    def on_first_token(self, seconds): self._saw("on_first_token")
    def on_token_interval(self, seconds): self._saw("on_token_interval")
    def on_finished(self, num_prompt_tokens, num_output_tokens): self._saw("on_finished")
    def on_kv_events(self, events): self._saw("on_kv_events")
    def on_heartbeat(self, last_round): self._saw("on_heartbeat")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "wait"])
def test_every_observer_hook_runs_on_the_output_thread(tiny_model_dir, overlap):
    """Never two hooks at once: Triton's custom metrics crash the server when two threads update one
    (backend/triton/metrics.py). The first heartbeat, sent while start() waits, is among them."""
    config = EngineConfig.create(model=str(tiny_model_dir), enable_kv_events=True)
    observer = Threads()
    loop = EngineLoop(lambda: LLMEngine(config), observer=observer, overlap_outputs=overlap).start()
    assert observer.seen == {"on_heartbeat": {"engine-output"}}
    recs = [submit(loop, f"c{i}", max_tokens=6) for i in range(3)]
    refused = Recorder()
    loop.submit(Submission("big", GenerationRequest(PROMPT, SamplingParams(max_tokens=10**7), stream=True),
                           refused.emit, refused.fail))
    assert all(rec.done.wait(30) for rec in recs) and refused.done.wait(30)
    deadline = time.monotonic() + 5
    while "on_idle" not in observer.seen and time.monotonic() < deadline:
        time.sleep(0.05)
    loop.shutdown()
    hooks = {"on_step", "on_refused", "on_idle", "on_first_token", "on_token_interval", "on_finished",
             "on_kv_events", "on_heartbeat"}
    assert observer.seen == {hook: {"engine-output"} for hook in hooks}


class ForwardLog:
    """The real runner, logging "forward" in `log` as each forward starts."""

    def __init__(self, inner: TorchRunner, log: list[str]):
        self.inner, self.log = inner, log
        self.model_config, self.num_blocks, self.block_size = inner.model_config, inner.num_blocks, inner.block_size

    def forward(self, batch, between_layers=None):
        self.log.append("forward")
        return self.inner.forward(batch, between_layers)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "wait"])
def test_a_waiting_loop_sends_a_steps_outputs_before_the_next_step(tiny_model_dir, overlap):
    """Waiting (the default where the forward fills the CPUs), no forward starts while an output is being sent;
    overlapping, forwards run during the (here slow) sends."""
    config = EngineConfig.create(model=str(tiny_model_dir), num_kv_blocks=256)
    log: list[str] = []
    runner = ForwardLog(TorchRunner(config.model, config.dtype, 256, config.cache.block_size), log)
    loop = EngineLoop(lambda: LLMEngine(config, runner=runner), overlap_outputs=overlap).start()
    recs = [Recorder() for _ in range(3)]
    for i, rec in enumerate(recs):
        def emit(out, rec=rec) -> None:
            log.append("send")
            time.sleep(0.01)
            rec.emit(out)
            log.append("sent")

        loop.submit(Submission(f"c{i}", GenerationRequest(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True),
                                                          stream=True), emit, rec.fail))
    assert all(rec.done.wait(30) and rec.tokens and rec.ends == 1 for rec in recs)
    loop.shutdown()
    in_flight, forwards_during_a_send = 0, 0
    for event in log:
        in_flight += {"send": 1, "sent": -1}.get(event, 0)
        forwards_during_a_send += event == "forward" and in_flight > 0
    assert (forwards_during_a_send > 0) == overlap, log


def test_the_loop_waits_for_its_outputs_by_default_only_where_the_forward_fills_the_cpus(tiny_model_dir):
    threads = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0))
    try:
        for n in {1, cpus}:
            torch.set_num_threads(n)
            loop = EngineLoop(lambda: LLMEngine(EngineConfig.create(model=str(tiny_model_dir)))).start()
            assert loop.engine.fills_the_cpus == (n >= cpus) and loop.overlap_outputs == (n < cpus)
            loop.shutdown()
    finally:
        torch.set_num_threads(threads)


class Chunks(Recorder):
    """A Recorder that also keeps each output's size and logprobs."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []
        self.logprobs: list[float | None] = []

    def emit(self, out) -> None:
        self.sizes.append(len(out.new_token_ids))
        self.logprobs += out.new_logprobs
        super().emit(out)


def test_stream_interval_sends_the_same_tokens_in_fewer_outputs(loop, tiny_model_dir):
    """The first output at once, then every N steps, the last at once: the same tokens and logprobs as N = 1; a
    stop string still ends the output where it did (it is applied before outputs are held)."""
    tokenizer = load_tokenizer(tiny_model_dir)
    runs = {}
    for interval in (1, 4):
        rec = Chunks()
        req = GenerationRequest(PROMPT, SamplingParams(max_tokens=11, ignore_eos=True, logprobs=True), stream=True,
                                stream_interval=interval)
        loop.submit(Submission("c", req, rec.emit, rec.fail))
        assert rec.done.wait(30) and rec.ends == 1
        runs[interval] = rec
    assert runs[1].sizes == [1] * 11 and runs[4].sizes == [1, 4, 4, 2]
    assert runs[4].tokens == runs[1].tokens and runs[4].logprobs == runs[1].logprobs
    text = decode_text(tokenizer, runs[1].tokens)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    ends = []
    for interval in (1, 4):
        rec = submit(loop, max_tokens=11, stop_strings=[stop], stream_interval=interval)
        assert rec.done.wait(30) and rec.reasons == ["stop"]
        ends.append(rec.tokens)
    assert ends[0] == ends[1]
    assert loop.num_active == 0 and loop.engine.kv.num_used_blocks == 0


def test_the_servers_stream_interval_applies_unless_a_request_names_one(tiny_model_dir):
    config = EngineConfig.create(model=str(tiny_model_dir), stream_interval=3)
    loop = EngineLoop(lambda: LLMEngine(config)).start()
    try:
        default, own = Chunks(), Chunks()
        for rec, interval in ((default, 0), (own, 1)):
            req = GenerationRequest(PROMPT, SamplingParams(max_tokens=7, ignore_eos=True), stream=True,
                                    stream_interval=interval)
            loop.submit(Submission("c", req, rec.emit, rec.fail))
            assert rec.done.wait(30)
        assert default.sizes == [1, 3, 3] and own.sizes == [1] * 7 and default.tokens == own.tokens
    finally:
        loop.shutdown()
