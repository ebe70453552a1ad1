"""Locust load test of the Triton LLM server: streamed generations over gRPC (one stream per request,
through client.LLMClient) or HTTP (Triton's SSE `generate_stream`).

    locust -f load_tests/locustfile.py --headless -H 127.0.0.1:8001 -u 32 -r 32 -t 60s --stop-timeout 60
    LOAD_PROTOCOL=http locust -f load_tests/locustfile.py --headless -H http://127.0.0.1:8000 -u 8 -t 60s
    LOAD_SHAPE=poisson locust -f load_tests/locustfile.py --headless -H 127.0.0.1:8001 -u 8 --rate 2 -t 60s

--stop-timeout lets users finish the request in flight at the end; a gRPC user killed inside its stream has
hung a run at "Shape test stopping" (seen twice in ~10 test runs).

$LOAD_PROTOCOL picks the user classes locust sees: grpc (default, GrpcStreamUser), http (HttpStreamUser) or
grpc,http (both, by equal weight; they share -H, so only for a host that answers both, e.g. a proxy).
Each result goes to locust's stats as a custom request type, in a row named "<protocol> <model>":
  TTFT   time to first token (ms), one per request
  ITL    inter-token latency (ms), one per gap between streamed chunks, so stalls (a long prefill joining
         the batch) show in the percentiles instead of being averaged away per request
  E2E    request latency (ms); its "content size" is the request's output tokens. Failures are recorded
         here only, once per request, with their message: server errors (e.g. "overloaded"), timeouts, and
         streams that end without their final response
  TOK/S  output tokens per second of one request; NOTE its "response time" columns hold tok/s, not ms
Locust stores response times rounded (to 1 ms under 100, 10 ms under 1 s, 100 ms under 10 s), so the
percentiles carry that rounding. `python -m load_tests.summarize <prefix>_stats.csv` prints a table.

Load shapes ($LOAD_SHAPE, load_tests/shapes.py): constant (default; -u users at -r per second), step
(--step-users more every --step-seconds up to -u) and poisson (-u open-loop users started at once, each
sending at --rate / -u without waiting for its answers: a Poisson process of --rate requests per second).
--rate > 0 makes users open-loop under any shape; 0 (default) is closed-loop: each user sends its next
request when the previous one ends. Options below also read the environment variable in brackets.
"""

from __future__ import annotations

import atexit
import faulthandler
import itertools
import os
import random
import sys
import time
from collections.abc import Callable
from functools import cache

from grpc.experimental import gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any channel: grpc's C core must yield to gevent's hub

import gevent.pool  # noqa: E402
import requests  # noqa: E402
from locust import User, constant, events, task  # noqa: E402

from client.client import LLMClient  # noqa: E402
from load_tests import shapes  # noqa: E402
from load_tests.prompts import PROMPT_SETS, Prompt, make_prompts  # noqa: E402
from load_tests.streams import StreamRecord, grpc_stream, triton_sse_stream  # noqa: E402

NUM_PROMPTS = 512
LoadShape = shapes.select(os.environ.get("LOAD_SHAPE", "constant"))  # the one shape locust finds here
PROTOCOLS = set(os.environ.get("LOAD_PROTOCOL", "grpc").split(","))
if not PROTOCOLS <= {"grpc", "http"}:
    raise ValueError(f"LOAD_PROTOCOL={','.join(PROTOCOLS)}: expected grpc, http or grpc,http")
_user_seeds = itertools.count()


def token_range(text: str) -> tuple[int, int]:
    """--max-tokens as (low, high), inclusive: "64" or "16-128"."""
    low, _, high = text.partition("-")
    return int(low), int(high or low)


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    group = parser.add_argument_group("LLM load test (load_tests/locustfile.py)")
    group.add_argument("--model", default="llm", env_var="LOCUST_MODEL",
                       help="Triton model: llm (text in one hop), llm_bls or ensemble [LOCUST_MODEL]")
    group.add_argument("--prompt-set", default="chat", choices=list(PROMPT_SETS), env_var="LOCUST_PROMPT_SET",
                       help="[LOCUST_PROMPT_SET] see load_tests/prompts.py")
    group.add_argument("--prompt-seed", type=int, default=0, env_var="LOCUST_PROMPT_SEED",
                       help="seeds the prompt set and each user's draws [LOCUST_PROMPT_SEED]")
    group.add_argument("--max-tokens", default="16-128", env_var="LOCUST_MAX_TOKENS",
                       help="max_tokens per request, drawn uniformly from LOW-HIGH, or N [LOCUST_MAX_TOKENS]")
    group.add_argument("--stop-at-eos", action="store_true", env_var="LOCUST_STOP_AT_EOS",
                       help="let EOS end a generation (default: ignore_eos, exactly max_tokens) "
                       "[LOCUST_STOP_AT_EOS]")
    group.add_argument("--rate", type=float, default=0.0, env_var="LOCUST_RATE",
                       help="requests/s of all users together, open loop; 0: closed loop [LOCUST_RATE]")
    group.add_argument("--request-timeout", type=float, default=120.0, env_var="LOCUST_REQUEST_TIMEOUT",
                       help="longest wait for any one response, seconds [LOCUST_REQUEST_TIMEOUT]")
    group.add_argument("--step-users", type=int, default=4, env_var="LOCUST_STEP_USERS",
                       help="step shape: users added per step [LOCUST_STEP_USERS]")
    group.add_argument("--step-seconds", type=float, default=10.0, env_var="LOCUST_STEP_SECONDS",
                       help="step shape: seconds per step [LOCUST_STEP_SECONDS]")


EXIT_GRACE_S = 10.0


def _exit_now(exit_code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


@events.quit.add_listener
def _exit_even_if_grpc_lingers(exit_code: int, **_) -> None:
    """Ends the process with exit_code even where grpc's threads under gevent keep the interpreter from exiting: over
    gRPC, 1 run in ~2 (2026-11-25, 2-core Zen 5) printed its summary, logged "Shutting down (exit code 0)" and then
    never exited, until its caller's timeout (tests/test_load_tests.py failed CI rehearsals so). The quit event comes
    after the stats are printed and before the CSVs are closed; then, in turn:
    - an atexit hook (registered last, so run first) exits before the interpreter's teardown, where a thread that
      asks for the GIL is stopped for good (the likely reason the OS thread alone did not end a run that hung so in
      a full `make test`, 2026-12-02, Zen 4);
    - a real OS thread exits EXIT_GRACE_S later if the process is stuck before atexit (joining threads);
    - faulthandler's own C thread (no GIL needed) prints every thread's stack and exits 1 twice as late, so a hang
      past both is a failure that says where, not a silent timeout."""
    from gevent import monkey

    atexit.register(_exit_now, exit_code)
    sleep, start_thread = monkey.get_original("time", "sleep"), monkey.get_original("_thread", "start_new_thread")
    start_thread(lambda: (sleep(EXIT_GRACE_S), _exit_now(exit_code)), ())
    faulthandler.dump_traceback_later(2 * EXIT_GRACE_S, exit=True)


@cache
def prompt_set(name: str, seed: int) -> list[Prompt]:
    return make_prompts(name, NUM_PROMPTS, seed)


class StreamingUser(User):
    """Sends streamed generations and reports TTFT / ITL / E2E / TOK/S; subclasses speak a protocol."""

    abstract = True
    wait_time = constant(0)  # closed loop: the next request as soon as one ends; open loop sleeps in the task
    protocol = ""

    def on_start(self) -> None:
        options = self.environment.parsed_options
        token_range(options.max_tokens)  # a bad --max-tokens fails here, once, rather than per request
        self.rng = random.Random(options.prompt_seed * 1_000_003 + next(_user_seeds))
        self.in_flight = gevent.pool.Group()
        self.next_arrival = time.monotonic()

    def on_stop(self) -> None:
        self.in_flight.kill(timeout=5)  # open loop: requests still streaming when the test stops

    @task
    def generate(self) -> None:
        options = self.environment.parsed_options
        if options.rate <= 0:
            self.one_request()
            return
        # Arrivals on the clock, not sleeps end to end: a late wake-up (busy CPU) must not lower the rate.
        self.next_arrival += self.rng.expovariate(options.rate / (options.num_users or 1))
        gevent.sleep(max(0.0, self.next_arrival - time.monotonic()))
        self.in_flight.spawn(self.one_request)

    def one_request(self) -> None:
        options = self.environment.parsed_options
        prompt = self.rng.choice(prompt_set(options.prompt_set, options.prompt_seed))
        max_tokens = self.rng.randint(*token_range(options.max_tokens))
        fire = self.environment.events.request.fire
        name = f"{self.protocol} {options.model}"
        start = time.monotonic()
        try:
            record = self.send(prompt, max_tokens, not options.stop_at_eos, options.request_timeout)
        except Exception as err:  # noqa: BLE001 - every failure is a failed request with its message
            fire(request_type="E2E", name=name, response_time=(time.monotonic() - start) * 1000,
                 response_length=0, exception=err, context={})
            return
        report(fire, name, record)

    def send(self, prompt: Prompt, max_tokens: int, ignore_eos: bool, timeout: float) -> StreamRecord:
        raise NotImplementedError


def report(fire: Callable[..., None], name: str, record: StreamRecord) -> None:
    def event(kind: str, value: float, length: int = 0) -> None:
        fire(request_type=kind, name=name, response_time=value, response_length=length, exception=None,
             context={})

    event("TTFT", record.ttft * 1000)
    for gap in record.itls:
        event("ITL", gap * 1000)
    event("E2E", record.e2e * 1000, record.output_tokens)
    event("TOK/S", record.tok_s)


class GrpcStreamUser(StreamingUser):
    """-H host:port of Triton's gRPC endpoint (a grpc:// prefix is dropped)."""

    abstract = "grpc" not in PROTOCOLS
    protocol = "grpc"

    def on_start(self) -> None:
        super().on_start()
        self.idle: list[LLMClient] = []  # one client per request in flight (LLMClient is one at a time)

    def on_stop(self) -> None:
        super().on_stop()
        for client in self.idle:
            client.close()

    def send(self, prompt: Prompt, max_tokens: int, ignore_eos: bool, timeout: float) -> StreamRecord:
        options = self.environment.parsed_options
        url = (self.host or "127.0.0.1:8001").removeprefix("grpc://")
        client = self.idle.pop() if self.idle else LLMClient(url, options.model)
        try:
            return grpc_stream(client, prompt.text, max_tokens, prompt.chat, ignore_eos, timeout)
        finally:
            self.idle.append(client)


class HttpStreamUser(StreamingUser):
    """-H http://host:port of Triton's HTTP endpoint."""

    abstract = "http" not in PROTOCOLS
    protocol = "http"

    def on_start(self) -> None:
        super().on_start()
        self.session = requests.Session()

    def on_stop(self) -> None:
        super().on_stop()
        self.session.close()

    def send(self, prompt: Prompt, max_tokens: int, ignore_eos: bool, timeout: float) -> StreamRecord:
        options = self.environment.parsed_options
        url = (self.host or "http://127.0.0.1:8000").rstrip("/")
        return triton_sse_stream(self.session, url, options.model, prompt.text, max_tokens, prompt.chat,
                                 ignore_eos, timeout)
