"""The Dynamo worker's command line (no Dynamo import: the compose checks parse it from the main venv)."""

from __future__ import annotations

import argparse
import os

from backend.engine.config import setting_fields
from backend.serving.model_store import MODEL_NAME


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="This engine as a Dynamo worker (token ids in, token ids out).")
    p.add_argument("--served-model-name", default=MODEL_NAME, help="the name clients ask for")
    p.add_argument("--namespace", default="dynamo")
    p.add_argument("--component", default="backend")
    p.add_argument("--discovery-backend", default="file", choices=["file", "etcd", "kubernetes"],
                   help="file: one host, no etcd/NATS (DYN_FILE_KV names the folder)")
    p.add_argument("--event-plane", default="zmq", choices=["zmq", "nats"])
    p.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                   help="disaggregated serving: prefill workers run prompts and hand their KV blocks to decode "
                        "workers (docs/dynamo.md)")
    p.add_argument("--kv-transport", default="nixl", choices=["nixl", "tcp"],
                   help="prefill role: how decode workers get the KV blocks (NIXL over UCX, or a plain TCP pull)")
    p.add_argument("--kv-host", default=os.environ.get("DYN_TCP_RPC_HOST", "127.0.0.1"),
                   help="prefill role, tcp transport: the address decode workers fetch KV blocks from (default: the "
                        "one this worker serves requests on, DYN_TCP_RPC_HOST, else 127.0.0.1)")
    p.add_argument("--dyn-tool-call-parser", default=None, metavar="NAME",
                   help="the frontend's parser for tool calls in this model's output, as Dynamo's own workers name "
                        "it: hermes fits ChatML models such as SmolLM2 (<tool_call>{...}</tool_call>); default: none")
    p.add_argument("--dyn-reasoning-parser", default=None, metavar="NAME",
                   help="the frontend's parser that moves this model's reasoning into reasoning_content, as Dynamo's "
                        "own workers name it: qwen3 for Qwen3's <think>...</think> (docs/dynamo.md); default: none")
    engine = p.add_argument_group("engine settings (as in config.pbtxt; defaults in backend/engine/config.py)")
    for name, field in setting_fields().items():
        engine.add_argument("--" + name.replace("_", "-"), dest=name, metavar=str(field.type).split(" |")[0].upper(),
                            help="default: model store's SmolLM2" if name == "model" else None)
    return p
