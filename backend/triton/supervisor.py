"""Watch a running tritonserver for the faults Triton does not notice, so the launcher can start it again.

- A python backend stub that died. Triton 2.51 restarts a non-decoupled model's stub on its next request but
  never a decoupled one's (llm, llm_bls): after `kill -9` of llm's stub every request failed with "Stub process
  'llm_0_0' is not healthy" for as long as we watched, streams in flight never ended, and /v2/health/ready
  kept answering 200. Reloading the model through the model-control API brings it back in ~5 s, but the dead
  stub's streams still never end and its instance stays UNLOADING forever, holding them.
- An engine loop that died or stopped making progress: the llm model's heartbeat gauge (see
  backend/serving/engine_thread.py) is -1 or older than the stall timeout.
- A gRPC stream door that no longer answers: Triton 2.51's stream handler deadlocked once in a test run (docs/
  reliability.md), after which no new gRPC stream got a response while HTTP, unary gRPC and readiness still
  answered and the engine idled. Every PROBE_S a new stream asks for a model that does not exist: Triton's stream
  handler answers that itself, with an error, so the probe costs no model any work. A frozen tritonserver (SIGSTOP,
  a stuck host) fails it too.

Such a server is killed, not stopped gracefully (its in-flight requests can never finish): their clients get a
broken connection at once, and the ready endpoint answers nothing until the new server is ready. Before a
wedged engine's server is killed, its stubs write their threads' Python stacks to the server log.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

STUB = "triton_python_backend_stub"
HEARTBEAT = "llm_engine_heartbeat_timestamp_seconds"
DUMP_WAIT_S = 1.0  # for the stubs' stack dumps to reach the log before the kill
PROBE_S = 10.0  # how often a new gRPC stream is opened to see that the stream door answers
PROBE_MODEL = "supervisor-probe-no-such-model"


def stub_processes(server_pid: int) -> dict[str, int]:
    """Model instance name (e.g. llm_0_0) -> pid, for each live python backend stub of this server."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            args = (stat.parent / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(ppid) == server_pid and state != "Z" and args[0].endswith(STUB.encode()):
            found[args[-2].decode()] = int(stat.parent.name)  # the stub's arguments end "<instance> <runtime>"
    return found


def heartbeats(metrics_text: str) -> dict[str, float]:
    """Model label -> the engine loop's heartbeat, from a Prometheus scrape."""
    beats = {}
    for line in metrics_text.splitlines():
        if line.startswith(HEARTBEAT + "{"):
            labels, value = line[len(HEARTBEAT) + 1:].rsplit("} ", 1)
            model = next((kv.split("=", 1)[1].strip('"') for kv in labels.split(",") if kv.startswith("model=")), "")
            beats[model] = float(value)
    return beats


def stream_answers(url_grpc: str, timeout_s: float) -> bool:
    """Whether a new gRPC stream on `url_grpc` (host:port) gets a response within `timeout_s`: a request for a
    model that does not exist, which Triton's stream handler refuses itself."""
    with grpc.insecure_channel(url_grpc) as channel:
        stream = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter([service_pb2.ModelInferRequest(model_name=PROBE_MODEL)]), timeout=timeout_s)
        try:
            next(stream)
        except grpc.RpcError as err:
            return err.code() != grpc.StatusCode.DEADLINE_EXCEEDED  # e.g. UNAVAILABLE: a door being shut, not stuck
        except StopIteration:
            pass
        return True


class Supervised(Protocol):
    """What the supervisor needs of a server: the launcher's TritonServer (the launcher imports this)."""

    @property
    def pid(self) -> int: ...

    @property
    def url_metrics(self) -> str: ...

    @property
    def url_grpc(self) -> str: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...


@dataclass
class Supervisor:
    server: Supervised
    stall_timeout_s: float = 30.0  # a step, or a new stream's answer, may take this long; 0: neither is checked
    poll_s: float = 1.0
    _stubs: dict[str, int] = field(default_factory=dict, init=False)
    _probed_at: float = field(default=0.0, init=False)

    def wait(self) -> str:
        """Block until the server exits or turns unhealthy (it is then killed); why, for the log."""
        self._stubs = stub_processes(self.server.pid)
        while self.server.poll() is None:
            time.sleep(self.poll_s)
            if (reason := self.check()) and self.server.poll() is None:
                self.server.kill()
                return f"{reason}: killed tritonserver"
        return f"tritonserver exited with {self.server.poll()}"

    def _dump_stacks(self) -> None:
        """Every live stub writes its threads' Python stacks to the server log (SIGUSR1, backend/triton/glue.py),
        so a wedged engine's log says where it was stuck."""
        for pid in stub_processes(self.server.pid).values():
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(DUMP_WAIT_S)

    def check(self) -> str | None:
        """Why the server cannot serve, or None."""
        live = stub_processes(self.server.pid)
        for name, pid in self._stubs.items():
            if name not in live:
                return f"the python backend stub of {name} (pid {pid}) died"
        self._stubs = live  # Triton may have restarted a non-decoupled model's stub under a new pid
        if self.stall_timeout_s <= 0:
            return None
        if time.monotonic() - self._probed_at >= PROBE_S:
            if not stream_answers(self.server.url_grpc, self.stall_timeout_s):
                return f"a new gRPC stream got no response in {self.stall_timeout_s:.0f} s (stall timeout)"
            self._probed_at = time.monotonic()
        try:
            with urllib.request.urlopen(self.server.url_metrics, timeout=5) as resp:
                beats = heartbeats(resp.read().decode())
        except OSError:
            return None  # no judgement from a busy or metrics-less server
        for model, last in beats.items():
            if last < 0:
                return f"the engine loop of {model} died"
            if last > 0 and (stalled := time.time() - last) > self.stall_timeout_s:
                self._dump_stacks()
                return f"the engine loop of {model} has made no progress for {stalled:.0f} s (stall timeout " \
                       f"{self.stall_timeout_s:.0f} s; the stubs' stacks are in the server log)"
        return None
