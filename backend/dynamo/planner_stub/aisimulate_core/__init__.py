"""A stand-in for `aisimulate_core`, the SLA planner's simulator, which no package index here has (ai-dynamo 1.6.1 pins
`aisimulate==0.13.0`, whose install fetches from an unreachable index). Dynamo's planner imports it at module level
(`dynamo/planner/core/perf_model/ais_adapter.py`: `from aisimulate_core.sdk import ForwardPassPerfModelConfig`) even
in load mode, which never uses it. So the names import, and any use of one raises ImportError naming this package:
a code path that needs the simulator fails loudly. backend/dynamo/planner.py puts this folder on the planner's path
only, and refuses `optimization_target: sla` by name before the planner starts.
"""

from __future__ import annotations

MESSAGE = "aisimulate_core: the SLA planner's simulator is not installable here"


class Refused:
    """A name of aisimulate_core: calling it, or reading an attribute of it, raises ImportError."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str):
        raise ImportError(f"{MESSAGE} ({self._name}.{attr})")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{MESSAGE} ({self._name}())")


def __getattr__(name: str) -> Refused:
    if name.startswith("__"):  # the import system's own probes (__path__, __spec__ ...) stay plain misses
        raise AttributeError(name)
    return Refused(name)
