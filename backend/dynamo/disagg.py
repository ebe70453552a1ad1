"""Disaggregated prefill and decode: what a worker does differently in each role.

Dynamo's frontend sends a request first to a prefill worker (max_tokens forced to 1), takes the
`disaggregated_params` of its last response and sends the request on to a decode worker as
`prefill_result`. Here:
- prefill: run the prompt; the engine thread exports its full blocks' K/V right after the step that ends
  it; the export waits in `KVServer` and its address goes out as `disaggregated_params`.
- decode: fetch the blocks, import them into the prefix cache, and run the request as usual: admission finds
  them cached and computes only the rest (at least the last prompt token, whose logits give the first
  output token). A request without `prefill_result` (a prompt shorter than one block, which exports
  nothing) is prefilled here. A failed fetch is logged and the request is prefilled here too: slower,
  never wrong, never stuck.
- both: a plain worker.
The metrics say how many requests went each way and what the transfers cost.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from backend.dynamo import kv_nixl
from backend.dynamo.kv_transport import KVServer, fetch
from backend.serving.request import GenerationRequest

LOG = logging.getLogger(__name__)
ROLES = ("both", "prefill", "decode")
TRANSPORTS = ("nixl", "tcp")
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Disaggregation:
    def __init__(self, role: str, transport: str = "nixl", kv_host: str = "127.0.0.1"):
        if role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"kv_transport: expected one of {TRANSPORTS}, got {transport!r}")
        self.role = role
        self.registry = CollectorRegistry()
        sent = Counter("llm_kv_sent_bytes", "KV bytes decode workers fetched from this prefill worker",
                       registry=self.registry)
        self.server = None
        if role == "prefill":  # the prefill side picks the transport; its params tell the decode side
            self.server = (kv_nixl.NixlKVServer(on_sent=sent.inc) if transport == "nixl"
                           else KVServer(kv_host, on_sent=sent.inc))
        self._nixl: kv_nixl.NixlFetcher | None = None
        self.requests = Counter("llm_disagg_requests", "Requests by where their prompt was prefilled",
                                ["prefill"], registry=self.registry)
        self.transfer_seconds = Histogram("llm_kv_transfer_seconds", "Fetching one request's KV blocks",
                                          buckets=SECONDS, registry=self.registry)
        self.transfer_bytes = Counter("llm_kv_transfer_bytes", "KV bytes fetched from prefill workers",
                                      registry=self.registry)
        if self.server is not None:
            Gauge("llm_kv_exports_pending", "Prefill exports not yet fetched (dropped once read, or after 60 s)",
                  registry=self.registry).set_function(lambda: self.server.num_pending)

    async def start(self) -> None:
        if self.server is not None:
            await self.server.start()

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def prepare(self, request: dict, req: GenerationRequest) -> tuple[GenerationRequest, dict | None]:
        """The request as this role runs it, and (prefill) the dict the export's address will fill."""
        if self.role == "prefill":
            params = dataclasses.replace(req.params, max_tokens=1, min_tokens=0)
            # Dynamo requires the params on every prefill; no handle: nothing to fetch (prompt under a block)
            return dataclasses.replace(req, params=params, stop_strings=[]), {"kv_tokens": 0}
        prefill = (request.get("prefill_result") or {}).get("disaggregated_params") or {}
        if self.role == "decode" and "kv_handle" in prefill:
            try:
                kv, transfer = await self._fetch(prefill)
            except ConnectionError as err:
                LOG.warning("%s; prefilling here instead", err)
                self.requests.labels("local_after_failed_transfer").inc()
                return req, None
            self.transfer_seconds.observe(transfer.seconds)
            self.transfer_bytes.inc(transfer.num_bytes)
            self.requests.labels("remote").inc()
            return dataclasses.replace(req, kv=kv), None
        self.requests.labels("local").inc()
        return req, None

    async def _fetch(self, params: dict):
        if params.get("kv_transport") != "nixl":
            return await fetch(params)
        if self._nixl is None:
            self._nixl = kv_nixl.NixlFetcher()
        return await self._nixl.fetch(params)

    def export_to(self, params: dict) -> Any:
        """The engine thread's export hook for a prefill request: keep the blocks, fill `params`. A prompt
        shorter than a block exports nothing: the decode worker computes it (no handle, no fetch)."""
        return lambda kv: params.update(self.server.put(kv)) if kv.num_blocks else None
