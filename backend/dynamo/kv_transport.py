"""Moving a prefill's KV blocks to the decode worker: a TCP pull, one connection per request.

The prefill worker keeps each export in memory under a random handle (`KVServer.put`) and hands the
handle, with its address, to Dynamo as the prefill's `disaggregated_params`; the decode worker connects,
sends the handle and reads a JSON header line and the raw K/V bytes (`fetch`). An export is sent once and
then dropped, or dropped after `ttl` seconds if no decode worker asks (a client that went away): memory
on the prefill side never waits for a peer that is not coming. The blocks themselves were never held:
they stay in the prefill worker's prefix cache like any finished request's.

One host and several alike: TCP over loopback costs a copy or two more than shared memory would, and NIXL
(RDMA, GPU memory) is the GPU-cluster answer; the interface is these two calls.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from backend.engine.kv_transfer import ExportedKV

CHUNK = 1 << 20


@dataclass
class Transfer:
    num_bytes: int
    seconds: float


def _payload(kv: ExportedKV) -> tuple[dict, memoryview]:
    data = kv.data.contiguous()
    header = {"num_tokens": kv.num_tokens, "block_size": kv.block_size, "shape": list(data.shape),
              "dtype": str(data.dtype).removeprefix("torch.")}
    return header, memoryview(data.view(torch.uint8).numpy().reshape(-1))


class KVServer:
    def __init__(self, host: str = "127.0.0.1", ttl: float = 60.0, on_sent: Callable[[int], None] = lambda n: None):
        self.host, self.ttl, self.on_sent = host, ttl, on_sent  # on_sent: the bytes of each export sent whole
        self.port: int | None = None
        self._exports: dict[str, tuple[float, ExportedKV]] = {}
        self._lock = threading.Lock()  # put() runs on the engine's output thread, serving on the event loop
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        with self._lock:
            self._exports.clear()

    def put(self, kv: ExportedKV) -> dict:
        """Keep `kv` for one fetch; returns the `disaggregated_params` a decode worker fetches it with."""
        handle, now = secrets.token_hex(16), time.monotonic()
        with self._lock:
            for old in [h for h, (at, _) in self._exports.items() if now - at > self.ttl]:
                del self._exports[old]
            self._exports[handle] = (now, kv)
        return {"kv_host": self.host, "kv_port": self.port, "kv_handle": handle, "kv_tokens": kv.num_tokens}

    @property
    def num_pending(self) -> int:
        return len(self._exports)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            handle = (await reader.readline()).decode().strip()
            with self._lock:
                entry = self._exports.pop(handle, None)
            if entry is None:
                writer.write(json.dumps({"error": f"no KV export {handle!r} (expired or sent)"}).encode() + b"\n")
            else:
                header, body = _payload(entry[1])
                writer.write(json.dumps(header).encode() + b"\n")
                for start in range(0, len(body), CHUNK):
                    writer.write(body[start:start + CHUNK])
                    await writer.drain()
                self.on_sent(len(body))
            await writer.drain()
        finally:
            writer.close()


async def fetch(params: dict, timeout: float = 30.0) -> tuple[ExportedKV, Transfer]:
    """The export named by a prefill's `disaggregated_params`; raises ConnectionError naming what failed."""
    start = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(params["kv_host"], params["kv_port"]), timeout)
    except (OSError, asyncio.TimeoutError) as err:
        raise ConnectionError(f"kv_transfer: cannot reach the prefill worker at "
                              f"{params['kv_host']}:{params['kv_port']} ({err!r})") from None
    try:
        writer.write(params["kv_handle"].encode() + b"\n")
        await writer.drain()
        header = json.loads(await asyncio.wait_for(reader.readline(), timeout) or b"{}")
        if "error" in header or "shape" not in header:
            raise ConnectionError(f"kv_transfer: {header.get('error', 'the prefill worker closed the connection')}")
        dtype = getattr(torch, header["dtype"])
        size = torch.Size(header["shape"]).numel() * torch.empty(0, dtype=dtype).element_size()
        body = await asyncio.wait_for(reader.readexactly(size), timeout)
    except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError) as err:
        raise ConnectionError(f"kv_transfer: the transfer from {params['kv_host']}:{params['kv_port']} "
                              f"broke off ({err!r})") from None
    finally:
        writer.close()
    data = torch.frombuffer(bytearray(body), dtype=torch.uint8).view(dtype).reshape(header["shape"])
    kv = ExportedKV(header["num_tokens"], header["block_size"], data)
    return kv, Transfer(size, time.perf_counter() - start)
