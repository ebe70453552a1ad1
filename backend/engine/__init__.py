"""The engine core: `from backend.engine import LLMEngine, EngineConfig, SamplingParams`.

Imports torch and numpy, never a front door (Triton, Dynamo), build_engine, client or load_tests. The
names load lazily, so `backend.engine.errors` stays importable without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLMEngine": "engine", "RequestOutput": "engine", "EngineStats": "engine",
    "EngineConfig": "config", "SchedulerConfig": "config", "CacheConfig": "config", "TenantQuota": "config",
    "SamplingParams": "sampling",
    "InvalidRequestError": "errors", "QueueFullError": "errors", "UnknownRequestError": "errors",
    "FinishReason": "sequence",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'backend.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"backend.engine.{_EXPORTS[name]}"), name)
