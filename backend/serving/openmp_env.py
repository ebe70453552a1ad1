"""The OpenMP environment the serving processes (Triton's stubs, Dynamo's workers) start with.

OpenMP workers spin ~0.1 ms at a barrier before they sleep, where the user set neither OMP_WAIT_POLICY nor
GOMP_SPINCOUNT: a forward is hundreds of short parallel regions, and waking a sleeping worker costs tens of
microseconds each time (2-core Xeon, SmolLM2, the offline engine on a burst of 40 streams: 184 -> 213-228 tok/s
against sleeping workers; docs/benchmarks-log.md#openmp-wait-policy). libgomp's own default (~3 ms) serves 3.6x less
beside a busy process, this short spin 0.71x, which the engine answers by running on the CPUs the others leave free
(backend/engine/cpu_share.py). OMP_WAIT_POLICY=PASSIVE makes the workers sleep at once.
"""

from __future__ import annotations

SPIN_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}


def openmp_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with SPIN_DEFAULTS where it sets neither variable (a set GOMP_SPINCOUNT overrides even PASSIVE)."""
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return env
    return {**env, **SPIN_DEFAULTS}
