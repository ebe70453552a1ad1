"""The virtual connector's other end (ai-dynamo's `VirtualConnectorClient`): the planner's scaling decisions relayed to
the launcher, which owns the worker processes (scaling.py). Each decision is one JSON line on stdout; the launcher
answers with a line on stdin once the workers are at the decision's count, and the decision is then marked complete
(the planner waits for that before it decides again). Runs in .venv-dynamo with the cluster's environment.

    python -m backend.dynamo.scaler [--namespace dynamo]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from dynamo._core import VirtualConnectorClient  # as dynamo.planner imports it
from dynamo.runtime import DistributedRuntime, dynamo_worker


@dynamo_worker()
async def relay(runtime: DistributedRuntime, namespace: str) -> None:
    client = VirtualConnectorClient(runtime, namespace)
    loop = asyncio.get_running_loop()
    while True:
        await client.wait()
        decision = await client.get()
        print(json.dumps({"decision_id": decision.decision_id, "decode": decision.num_decode_workers,
                          "prefill": decision.num_prefill_workers}), flush=True)
        if not await loop.run_in_executor(None, sys.stdin.readline):  # the launcher went away
            return
        await client.complete(decision)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="dynamo")
    asyncio.run(relay(p.parse_args().namespace))


if __name__ == "__main__":
    main()
