"""Moving a prefill's KV blocks with NVIDIA NIXL (UCX backend): the decode worker READs them one-sided.

The same two calls as the TCP transport (backend/dynamo/kv_transport.py): the prefill worker registers each
export's host buffer with its NIXL agent and hands out, in `disaggregated_params`, the agent's connection
info with that buffer's keys (partial metadata) and the buffer's descriptors; the decode worker loads them,
READs into a buffer of its own and tags the transfer with the export's handle. The tag comes back to the prefill worker as a NIXL
notification, and only then is the buffer deregistered and dropped (or after `ttl` seconds, for a decode
worker that never came). UCX picks shared memory on one host and TCP or RDMA between hosts.

Runs on these CPU machines from the `nixl-cu12` wheel installed without its CUDA dependencies (UCX on host
memory needs none); 45 MB moved process to process in ~20 ms here. The agents run without NIXL's progress
thread: it polls, and on 2 cores its spinning cost the engines 60 % of their throughput (bench_cluster
--layout disagg: 32.7 vs 79.1 output tok/s); the transfers progress when the fetch loop and the prefill
worker's reaper (every 5 ms) ask for their state.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from backend.dynamo.kv_transport import Transfer
from backend.engine.kv_transfer import ExportedKV

try:
    from nixl_cu12._api import nixl_agent, nixl_agent_config
except ImportError:  # the wheel is in .venv-dynamo (scripts/dynamo_env.sh); the TCP transport needs nothing
    nixl_agent = nixl_agent_config = None

AVAILABLE = nixl_agent is not None


def _agent(role: str) -> Any:
    if not AVAILABLE:
        raise RuntimeError("kv_transport: nixl is not installed (nixl-cu12; scripts/dynamo_env.sh installs it)")
    return nixl_agent(f"{role}-{secrets.token_hex(6)}", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class NixlKVServer:
    def __init__(self, ttl: float = 60.0, on_sent: Callable[[int], None] = lambda n: None):
        self.ttl, self.on_sent = ttl, on_sent  # on_sent: the bytes of each export a decode worker read
        self._agent = _agent("prefill")
        self._name = self._agent.name
        self._exports: dict[str, tuple[float, torch.Tensor, Any]] = {}  # handle -> (time, buffer, registration)
        self._lock = threading.Lock()  # put() runs on the engine's output thread, the reaper on the event loop
        self._reaper: asyncio.Task | None = None

    async def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        with self._lock:
            for handle in list(self._exports):
                self._drop(handle)

    def put(self, kv: ExportedKV) -> dict:
        data = kv.data.contiguous()
        handle = secrets.token_hex(16)
        with self._lock:
            registration = self._agent.register_memory(data)
            descs = self._agent.get_serialized_descs(self._agent.get_xfer_descs(data))
            # the connection and this buffer's keys: the decode side loads it before each READ
            metadata = self._agent.get_partial_agent_metadata(registration, inc_conn_info=True)
            self._exports[handle] = (time.monotonic(), data, registration)
        return {"kv_transport": "nixl", "kv_handle": handle, "kv_tokens": kv.num_tokens, "block_size": kv.block_size,
                "shape": list(data.shape), "dtype": str(data.dtype).removeprefix("torch."),
                "nixl_agent": self._name, "nixl_metadata": _b64(metadata), "nixl_descs": _b64(descs)}

    @property
    def num_pending(self) -> int:
        return len(self._exports)

    def reap(self) -> None:
        """Drop the exports whose READ is done (the decode worker's notification) or that outlived the ttl."""
        with self._lock:
            done = {msg.decode() for msgs in self._agent.get_new_notifs().values() for msg in msgs}
            now = time.monotonic()
            for handle, (at, data, _) in list(self._exports.items()):
                if handle in done:
                    self.on_sent(data.numel() * data.element_size())
                if handle in done or now - at > self.ttl:
                    self._drop(handle)

    def _drop(self, handle: str) -> None:
        _, _, registration = self._exports.pop(handle)
        self._agent.deregister_memory(registration)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(0.005)
            self.reap()


class NixlFetcher:
    """The decode worker's side: one agent; each export's metadata is loaded before its READ."""

    def __init__(self):
        self._agent = _agent("decode")

    async def fetch(self, params: dict) -> tuple[ExportedKV, Transfer]:
        start = time.perf_counter()
        dtype = getattr(torch, params["dtype"])
        data = torch.empty(params["shape"], dtype=dtype)
        agent, remote = self._agent, params["nixl_agent"]
        registration = agent.register_memory(data)
        try:
            agent.add_remote_agent(base64.b64decode(params["nixl_metadata"]))
            descs = agent.deserialize_descs(base64.b64decode(params["nixl_descs"]))
            xfer = agent.initialize_xfer("READ", agent.get_xfer_descs(data), descs, remote,
                                         params["kv_handle"].encode())
            state = agent.transfer(xfer)
            deadline = time.monotonic() + 30
            while state == "PROC" and time.monotonic() < deadline:
                await asyncio.sleep(0.0005)
                state = agent.check_xfer_state(xfer)
            agent.release_xfer_handle(xfer)
        except Exception as err:  # noqa: BLE001 - NIXL raises its own types; the caller prefills locally
            raise ConnectionError(f"kv_transfer: NIXL READ from {remote} failed ({err!r})") from None
        finally:
            agent.deregister_memory(registration)
        if state != "DONE":
            raise ConnectionError(f"kv_transfer: NIXL READ from {remote} ended {state}")
        size = data.numel() * data.element_size()
        return ExportedKV(params["kv_tokens"], params["block_size"], data), Transfer(size, time.perf_counter() - start)
