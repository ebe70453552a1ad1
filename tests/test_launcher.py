"""A real tritonserver, started by backend.triton.launcher, streams a decoupled python model (no GPU needed)."""

from __future__ import annotations

import itertools
import os
import queue
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backend.serving.openmp_env import SPIN_DEFAULTS, openmp_env
from backend.triton.launcher import TritonInstall, TritonServer, find_tritonserver, free_ports
from backend.triton.supervisor import stub_processes

MODEL = "stream"
CONFIG = f"""
name: "{MODEL}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "n", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "out", data_type: TYPE_INT32, dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""
MODEL_PY = """
import threading

import numpy as np
import torch  # the venv's packages must be visible to the stub's interpreter
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    # Tensors cross by DLPack, not pb_utils.Tensor(name, ndarray) / .as_numpy(): the wheel's stub
    # (pybind11 < 2.12) misreads numpy 2 arrays (empty outputs, repeated input elements).
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            n = int(np.from_dlpack(pb_utils.get_input_tensor_by_name(request, "n"))[0])
            thread = threading.Thread(target=self.stream, args=(request.get_response_sender(), n))
            thread.start()
            self.threads.append(thread)
        return None

    def stream(self, sender, n):
        values = torch.arange(n, dtype=torch.int32)
        for i in range(n):
            out = pb_utils.Tensor.from_dlpack("out", values[i : i + 1].clone())
            sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join()
"""
# The model is complete, so skip auto-complete: it would load model.py (and torch) in one more stub process.
FAST = ["--disable-auto-complete-config"]


def make_repository(root: Path, model_py: str = MODEL_PY) -> Path:
    version_dir = root / MODEL / "1"
    version_dir.mkdir(parents=True)
    (root / MODEL / "config.pbtxt").write_text(CONFIG)
    (version_dir / "model.py").write_text(textwrap.dedent(model_py))
    return root


def stream(url_grpc: str, n: int) -> list[tuple[list[int], bool]]:
    """(outputs, final flag) of each response to one streamed request, up to the final one (+0.5 s)."""
    responses: queue.Queue[tuple[grpcclient.InferResult | None, Exception | None]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url_grpc)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        tensor = grpcclient.InferInput("n", [1], "INT32")
        tensor.set_data_from_numpy(np.array([n], dtype=np.int32))
        client.async_stream_infer(MODEL, [tensor], enable_empty_final_response=True)
        received: list[tuple[list[int], bool]] = []
        while not (received and received[-1][1]):
            result, error = responses.get(timeout=30)
            assert error is None, error
            final = result.get_response().parameters["triton_final_response"].bool_param
            out = result.as_numpy("out")
            received.append(([] if out is None else out.tolist(), final))
        time.sleep(0.5)
        while not responses.empty():
            received.append(([-1], True))  # anything after the final response is a failure
            responses.get()
        return received
    finally:
        client.stop_stream()
        client.close()


def http_status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    tmp = tmp_path_factory.mktemp("triton")
    repository = make_repository(tmp / "repo")
    with TritonServer(repository, 0, 0, 0, extra_args=FAST, workdir=tmp / "run") as srv:
        yield srv


def test_wheel_is_located_without_importing_pytriton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITONSERVER_HOME", raising=False)
    install = find_tritonserver()
    assert (install.root / "bin" / "tritonserver").is_file()
    if install.stubs_dir is not None:  # the wheel, not a container's /opt/tritonserver
        assert install.libs_dir is not None and install.libs_dir.name == "nvidia_pytriton.libs"
        assert "pytriton" not in sys.modules


def test_tritonserver_home_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRITONSERVER_HOME", str(tmp_path))
    assert find_tritonserver() == TritonInstall(tmp_path)


def test_decoupled_model_streams_then_sends_one_final_response(server: TritonServer) -> None:
    received = stream(server.url_grpc, 5)
    assert received == [([i], False) for i in range(5)] + [([], True)]


def test_health_and_metrics_answer(server: TritonServer) -> None:
    assert http_status(f"{server.url_http}/v2/health/ready") == 200
    with urllib.request.urlopen(server.url_metrics, timeout=5) as resp:
        assert resp.status == 200 and b"nv_inference_request_success" in resp.read()


def test_stubs_spin_briefly_unless_the_user_chose(server: TritonServer) -> None:
    """The OpenMP default reaches the stubs where the user set neither variable; a user's choice is kept as set."""
    stubs = stub_processes(server.pid)
    assert stubs
    for pid in stubs.values():
        env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        user = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
        expected = user or SPIN_DEFAULTS
        assert {k: env.get(k.encode(), b"").decode() for k in expected} == expected
    assert openmp_env({"OMP_WAIT_POLICY": "PASSIVE"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_env({"GOMP_SPINCOUNT": "0"}) == {"GOMP_SPINCOUNT": "0"}
    assert openmp_env({"PATH": "/bin"}) == {"PATH": "/bin", "GOMP_SPINCOUNT": "10000"}


def test_second_server_runs_alongside(server: TritonServer, tmp_path: Path) -> None:
    with TritonServer(server.model_repository, 0, 0, 0, extra_args=FAST, workdir=tmp_path) as other:
        assert other.shm_prefix != server.shm_prefix
        assert {other.http_port, other.grpc_port} & {server.http_port, server.grpc_port} == set()
        assert list(Path("/dev/shm").glob(f"{other.shm_prefix}*"))
        assert stream(other.url_grpc, 3)[-1] == ([], True)
        assert stream(server.url_grpc, 2)[-1] == ([], True)
    assert not list(Path("/dev/shm").glob(f"{other.shm_prefix}*"))


def test_model_failure_is_raised_with_the_log_tail(tmp_path: Path) -> None:
    repository = make_repository(tmp_path / "repo", model_py="import no_such_module_xyz\n")
    srv = TritonServer(repository, 0, 0, 0, extra_args=FAST, workdir=tmp_path / "run")
    with pytest.raises(RuntimeError, match="no_such_module_xyz"):
        with srv:
            pass


def _cli(server: TritonServer, tmp_path: Path, *options: str) -> tuple[subprocess.Popen, int, Iterator[str]]:
    """`python -m backend.triton.launcher` on the test repository: the process, its HTTP port, its output lines."""
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "backend.triton.launcher", "--model-repository", str(server.model_repository),
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--log-file", str(tmp_path / "cli.log"), *options, "--", *FAST]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).parents[1], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    return proc, http, iter(proc.stdout.readline, "")


def stop_launcher(proc: subprocess.Popen) -> None:
    """Ctrl-C, then a kill if it has not exited within 60 s; for a test's `finally` (a SIGKILLed launcher would
    leave its tritonserver running)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _interrupt(proc: subprocess.Popen) -> None:
    """Ctrl-C: the launcher stops the server and exits 0."""
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, rest


def test_cli_serves_until_sigint(server: TritonServer, tmp_path: Path) -> None:
    proc, http, lines = _cli(server, tmp_path)
    try:
        # up to the launcher's last "ready" line, or its end
        printed = "".join(itertools.takewhile(lambda line: "Ctrl-C to stop" not in line, lines))
        assert "python -m client" in printed, printed
        assert http_status(f"http://127.0.0.1:{http}/v2/health/ready") == 200
        _interrupt(proc)
    finally:
        if proc.poll() is None:
            stop_launcher(proc)
    assert '"auto-complete-config":"false"' in (tmp_path / "cli.log").read_text()  # the `--` args got through
    with pytest.raises(OSError):
        http_status(f"http://127.0.0.1:{http}/v2/health/ready")


def test_cli_restarts_a_tritonserver_that_dies(server: TritonServer, tmp_path: Path) -> None:
    proc, http, lines = _cli(server, tmp_path, "--max-restarts", "1")
    try:
        "".join(itertools.takewhile(lambda line: "Ctrl-C to stop" not in line, lines))
        children = subprocess.run(["pgrep", "-P", str(proc.pid), "tritonserver"], capture_output=True, text=True)
        (pid,) = map(int, children.stdout.split())
        stubs = stub_processes(pid)
        os.kill(pid, signal.SIGKILL)  # as an abort in the python backend would end it
        printed = "".join(itertools.takewhile(lambda line: "tritonserver restarted" not in line, lines))
        assert "tritonserver exited with -9" in printed and "restarting it in 1 s (restart 1 of 1)" in printed
        # no orphans: SIGKILL lands asynchronously, and a loaded machine reaps the stub a moment later (seen in CI)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{stub}").exists() for stub in stubs.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stubs and not any(Path(f"/proc/{stub}").exists() for stub in stubs.values())
        assert http_status(f"http://127.0.0.1:{http}/v2/health/ready") == 200
        _interrupt(proc)
    finally:
        if proc.poll() is None:
            stop_launcher(proc)
