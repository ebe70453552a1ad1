"""The KV transport between prefill and decode workers: a TCP pull of exported blocks, sent once."""

import asyncio

import pytest
import torch

from backend.dynamo.kv_transport import KVServer, fetch
from backend.engine.kv_transfer import ExportedKV


def _kv(dtype: torch.dtype, blocks: int = 3) -> ExportedKV:
    return ExportedKV(blocks * 16, 16, torch.randn(2, 2, blocks, 16, 2, 8).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_export_arrives_bit_for_bit_once(dtype):
    async def run():
        sent: list[int] = []
        server = KVServer(on_sent=sent.append)
        await server.start()
        kv = _kv(dtype)
        params = server.put(kv)
        got, transfer = await fetch(params)
        assert got.num_tokens == 48 and got.block_size == 16 and got.data.dtype == dtype
        assert torch.equal(got.data, kv.data) and transfer.num_bytes == kv.data.numel() * kv.data.element_size()
        assert server.num_pending == 0 and sent == [transfer.num_bytes]  # counted on both sides alike
        with pytest.raises(ConnectionError, match="no KV export .* \\(expired or sent\\)"):
            await fetch(params)  # sent once
        assert sent == [transfer.num_bytes]  # a refused handle sends nothing
        await server.close()

    asyncio.run(run())


def test_unfetched_exports_expire_and_an_absent_peer_is_named():
    async def run():
        server = KVServer(ttl=0.0)
        await server.start()
        stale = server.put(_kv(torch.float32))
        await asyncio.sleep(0.01)
        server.put(_kv(torch.float32))  # a put drops what outlived the ttl
        assert server.num_pending == 1
        with pytest.raises(ConnectionError, match="expired or sent"):
            await fetch(stale)
        port = server.port
        await server.close()
        with pytest.raises(ConnectionError, match=f"cannot reach the prefill worker at 127.0.0.1:{port}"):
            await fetch({**stale, "kv_port": port})

    asyncio.run(run())


def test_the_listener_binds_only_the_configured_address():
    async def run():
        server = KVServer("127.0.0.2")  # a loopback address other than the default
        await server.start()
        assert {s.getsockname()[0] for s in server._server.sockets} == {"127.0.0.2"}
        assert server.put(_kv(torch.float32))["kv_host"] == "127.0.0.2"
        await server.close()

    asyncio.run(run())
