"""Clients that go away stop costing engine time, on the default endpoint (llm, text in one hop) and on
llm_bls, over HTTP and gRPC."""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlparse

import pytest

from client.client import LLMClient
from tests.test_server import metrics, wait_until_idle

STREAMS, MAX_TOKENS = 8, 1000


def _abandoned(server, leave) -> tuple[float, float]:
    """(seconds from the clients leaving to an idle engine, tokens the abandoned streams generated)."""
    before = metrics(server)["llm_generation_tokens_total"]
    leave()
    left_at = time.monotonic()
    after = wait_until_idle(server, timeout=2.0)  # the bound
    return time.monotonic() - left_at, after["llm_generation_tokens_total"] - before


DOORS = ("llm", "llm_bls")


@pytest.mark.parametrize("model", DOORS)
def test_http_clients_that_disconnect_stop_their_generation(server, model) -> None:
    url = urlparse(server.url_http)
    conns = []
    for i in range(STREAMS):
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        conn.request("POST", f"/v2/models/{model}/generate_stream",
                     json.dumps({"text_input": f"Essay {i}:", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                                 "stream": True}))
        response = conn.getresponse()
        assert response.status == 200 and response.read1(64).startswith(b"data: ")  # its first event
        conns.append(conn)

    def leave() -> None:
        for conn in conns:
            conn.sock.shutdown(2)
            conn.close()

    _, generated = _abandoned(server, leave)
    assert generated < STREAMS * MAX_TOKENS / 2


@pytest.mark.parametrize("model", DOORS)
def test_grpc_clients_that_cancel_their_stream_stop_their_generation(cancelling_server, model) -> None:
    server = cancelling_server
    clients = [LLMClient(server.url_grpc, model) for _ in range(STREAMS)]
    streams = [c.stream(f"Essay {i}:", max_tokens=MAX_TOKENS, ignore_eos=True, stream=True)
               for i, c in enumerate(clients)]
    for stream in streams:
        next(stream)

    def leave() -> None:  # as a client process that dies would: the stream is cancelled, no `stop` sent
        for client in clients:
            client._grpc.stop_stream(cancel_requests=True)
            client.close()

    _, generated = _abandoned(server, leave)
    assert generated < STREAMS * MAX_TOKENS / 2
