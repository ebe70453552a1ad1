"""The launcher's security defaults on a real tritonserver (the streaming model of test_launcher, no GPU):
Triton's admin APIs answer only a client with the key, health, metadata and inference answer anyone, and
the server listens on 127.0.0.1 unless told otherwise (docs/security.md)."""

from __future__ import annotations

import ast
import contextlib
import ipaddress
import itertools
import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend.triton.launcher import ADMIN_HEADER, ADMIN_KEY_ENV, GRPC_ADMIN_HEADER, TritonServer
from tests.test_launcher import FAST, MODEL, _cli, http_status, make_repository, stop_launcher, stream

# (method, path, body): one call of each restricted API group over HTTP
ADMIN_CALLS = [
    ("POST", "/v2/logging", {"log_verbose_level": 1}),
    ("POST", "/v2/systemsharedmemory/region/r/register", {"key": "/r", "offset": 0, "byte_size": 8}),
    ("GET", "/v2/models/stats", None),
    ("POST", "/v2/repository/index", {}),
    ("GET", f"/v2/models/{MODEL}/config", None),
    ("GET", "/v2/trace/setting", None),
]
OPEN_PATHS = ["/v2/health/ready", "/v2/health/live", "/v2", f"/v2/models/{MODEL}",
              f"/v2/models/{MODEL}/ready"]


def call(url: str, method: str, body: object = None, key: str | None = None) -> int:
    """The HTTP status of one request, with the admin header when a key is given."""
    headers = {} if key is None else {ADMIN_HEADER: key}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def listening(pid: int) -> dict[int, str]:
    """Port -> address of each TCP socket the process listens on (an IPv4-mapped IPv6 address as IPv4)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            inodes.add(os.readlink(fd).removeprefix("socket:[").removesuffix("]"))
        except OSError:
            pass  # closed meanwhile
    found = {}
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            local, state, inode = row.split()[1], row.split()[3], row.split()[9]
            address, port = local.split(":")
            if state == "0A" and inode in inodes:  # 0A: LISTEN; each 32-bit word is little-endian
                words = (bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
                ip = ipaddress.ip_address(b"".join(words))
                found[int(port, 16)] = str(getattr(ip, "ipv4_mapped", None) or ip)
    return found


@contextlib.contextmanager
def launched(server: TritonServer, tmp_path: Path, *options: str) -> Iterator[tuple[int, str, int]]:
    """The launcher CLI, once ready: (its HTTP port, its ready message, its tritonserver's pid). Stopped with
    Ctrl-C even when the test fails: a SIGKILLed launcher would leave its tritonserver running."""
    proc, http, lines = _cli(server, tmp_path, *options)
    try:
        printed = "".join(itertools.takewhile(lambda line: "Ctrl-C to stop" not in line, lines))
        pgrep = ["pgrep", "-P", str(proc.pid), "tritonserver"]
        (pid,) = map(int, subprocess.run(pgrep, capture_output=True, text=True).stdout.split())
        yield http, printed, pid
    finally:
        stop_launcher(proc)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """Started as the tests start theirs, with TRITON_ADMIN_KEY unset."""
    tmp = tmp_path_factory.mktemp("hardening")
    with pytest.MonkeyPatch.context() as env:
        env.delenv(ADMIN_KEY_ENV, raising=False)
        srv = TritonServer(make_repository(tmp / "repo"), 0, 0, 0, extra_args=FAST, workdir=tmp / "run")
    with srv:
        yield srv


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS, ids=[p for _, p, _ in ADMIN_CALLS])
def test_admin_api_refuses_a_client_without_the_key(server: TritonServer, method: str, path: str,
                                                     body: object) -> None:
    assert call(server.url_http + path, method, body) == 403
    assert call(server.url_http + path, method, body, key="wrong") == 403


def test_admin_api_answers_the_key(server: TritonServer) -> None:
    assert server.admin_key
    assert call(f"{server.url_http}/v2/logging", "POST", {"log_verbose_level": 1}, server.admin_key) == 200
    assert call(f"{server.url_http}/v2/models/stats", "GET", key=server.admin_key) == 200
    assert call(f"{server.url_http}/v2/repository/index", "POST", {}, server.admin_key) == 200


def test_grpc_admin_calls_need_the_key(server: TritonServer) -> None:
    client = grpcclient.InferenceServerClient(server.url_grpc)
    try:
        calls = [lambda headers: client.get_inference_statistics(headers=headers),
                 lambda headers: client.update_log_settings({"log_verbose_level": 1}, headers=headers),
                 lambda headers: client.get_model_config(MODEL, headers=headers),
                 lambda headers: client.get_model_repository_index(headers=headers)]
        for admin_call in calls:
            with pytest.raises(InferenceServerException, match="restricted"):
                admin_call(None)
            assert admin_call({GRPC_ADMIN_HEADER: server.admin_key}) is not None
    finally:
        client.close()


def test_health_metadata_and_inference_stay_open(server: TritonServer) -> None:
    assert [call(server.url_http + path, "GET") for path in OPEN_PATHS] == [200] * len(OPEN_PATHS)
    client = grpcclient.InferenceServerClient(server.url_grpc)
    try:
        assert client.is_server_ready() and client.is_model_ready(MODEL)
        assert client.get_model_metadata(MODEL).name == MODEL
    finally:
        client.close()
    assert stream(server.url_grpc, 3) == [([0], False), ([1], False), ([2], False), ([], True)]


def test_server_listens_on_loopback_only_by_default(server: TritonServer) -> None:
    sockets = listening(server.pid)
    assert {server.http_port, server.grpc_port, server.metrics_port} <= sockets.keys()
    assert set(sockets.values()) == {"127.0.0.1"}, sockets


def test_unset_key_is_random_and_kept_out_of_repr(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    first, second = (TritonServer(tmp_path, workdir=tmp_path) for _ in range(2))
    assert first.admin_key and second.admin_key and first.admin_key != second.admin_key
    assert first.admin_key not in repr(first)
    monkeypatch.setenv(ADMIN_KEY_ENV, "from-the-environment")
    assert TritonServer(tmp_path, workdir=tmp_path).admin_key == "from-the-environment"


def test_cli_takes_the_key_from_the_environment(server: TritonServer, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_KEY_ENV, "cli-test-key")
    with launched(server, tmp_path) as (http, printed, pid):
        assert f"`{ADMIN_HEADER}: ${ADMIN_KEY_ENV}`" in printed and "cli-test-key" not in printed, printed
        logging_url = f"http://127.0.0.1:{http}/v2/logging"
        assert call(logging_url, "POST", {"log_verbose_level": 1}) == 403
        assert call(logging_url, "POST", {"log_verbose_level": 1}, "cli-test-key") == 200
        assert set(listening(pid).values()) == {"127.0.0.1"}


def test_cli_host_and_open_admin_apis_open_it(server: TritonServer, tmp_path: Path) -> None:
    with launched(server, tmp_path, "--host", "0.0.0.0", "--open-admin-apis") as (http, printed, pid):
        assert "open to every client" in printed, printed
        sockets = listening(pid)
        assert len(sockets) == 3 and set(sockets.values()) <= {"0.0.0.0", "::"}, sockets
        assert http_status(f"http://127.0.0.1:{http}/v2/health/ready") == 200
        assert call(f"http://127.0.0.1:{http}/v2/logging", "POST", {"log_verbose_level": 1}) == 200


def test_supervisor_does_not_import_the_launcher() -> None:
    """launcher imports supervisor, so supervisor must not import launcher (not even for type checking)."""
    tree = ast.parse((Path(__file__).parents[1] / "backend" / "triton" / "supervisor.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
    assert "backend.triton.launcher" not in imported and "backend.triton" not in imported, imported
